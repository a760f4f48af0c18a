"""The fused experts' last step, the top-k sum, and the token scan that can run beside the GEMMs.

``out[m] = sum_s w[m, s] * y[m * topk + s]`` over the slots of local experts, in slot order,
float32 accumulation, no atomics: the same bits run to run (:func:`launch_topk_sum`, a program
per token and column block).

With few local experts most tokens need no sum: at 32 of 256 local experts with top-8 routing
~34% have no local slot (their row is zeros) and ~39% one (the flat down kernel writes that row
itself: ``fused_swiglu_experts(sole_pairs=...)``). A program per token still spends a launch slot
and a chain of dependent loads on each of them. :func:`start_token_scan` moves that work off the
sum's path: on a side stream, while the GEMMs run (they leave the memory's write bandwidth
mostly idle), a few programs per SM read every token's ids, write the zero rows and list the
tokens that need a sum (in no particular order: each token's sum is its own, so the bits do not
depend on it). :func:`launch_topk_sum` with that list then walks only those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dbo.moe.gather_reduce import _block
from dbo.moe.triton_launch import cdiv, launch, next_pow2

__all__ = ["TOPK_SUM_BLOCK", "SCAN_PROGRAMS_PER_SM", "LIST_PROGRAMS_PER_SM", "SCAN_ON_SIDE_STREAM",
           "TokenScan", "launch_topk_sum",
           "start_token_scan", "topk_sum_kernel", "topk_sum_list_kernel", "scan_tokens_kernel"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the module is only used where Triton is importable
    triton = None


if triton is not None:

    @triton.jit
    def _topk_row(y_ptr, ids_ptr, w_ptr, out_ptr, m, n_experts, hidden, TOPK: tl.constexpr,
                  BLOCK: tl.constexpr):
        # token m's columns of this program: a slot of another rank's expert reads nothing (its
        # row of y was never written)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            e = tl.load(ids_ptr + m * TOPK + s)
            if (e >= 0) & (e < n_experts):
                w = tl.load(w_ptr + m * TOPK + s).to(tl.float32)
                acc += w * tl.load(y_ptr + (m * TOPK + s) * hidden + cols, mask=mask,
                                   other=0.0).to(tl.float32)
        tl.store(out_ptr + m * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def topk_sum_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, n_experts, hidden, TOPK: tl.constexpr,
                        BLOCK: tl.constexpr, SOLE: tl.constexpr):
        # a program per (token, column block). SOLE: a token with one local slot is left alone
        # (the flat down kernel wrote its row)
        m = tl.program_id(0).to(tl.int64)
        if SOLE:
            n_local = 0
            for s in tl.static_range(TOPK):
                e = tl.load(ids_ptr + m * TOPK + s)
                n_local += ((e >= 0) & (e < n_experts)).to(tl.int32)
            if n_local != 1:
                _topk_row(y_ptr, ids_ptr, w_ptr, out_ptr, m, n_experts, hidden, TOPK, BLOCK)
        else:
            _topk_row(y_ptr, ids_ptr, w_ptr, out_ptr, m, n_experts, hidden, TOPK, BLOCK)

    @triton.jit
    def topk_sum_list_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, list_ptr, count_ptr, n_experts, hidden,
                             TOPK: tl.constexpr, BLOCK: tl.constexpr):
        # every num_programs(0)-th listed token, one column block per program(1)
        count = tl.load(count_ptr)
        for i in range(tl.program_id(0), count, tl.num_programs(0)):
            m = tl.load(list_ptr + i).to(tl.int64)
            _topk_row(y_ptr, ids_ptr, w_ptr, out_ptr, m, n_experts, hidden, TOPK, BLOCK)

    @triton.jit
    def scan_tokens_kernel(ids_ptr, out_ptr, list_ptr, count_ptr, n_tokens, n_experts, hidden,
                           TOPK: tl.constexpr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_H: tl.constexpr, MIN_SUM: tl.constexpr):
        # every num_programs-th block of ROWS tokens: the rows of those with no local slot are
        # written as zeros; those with at least MIN_SUM local slots are appended to the list
        # (count_ptr: its length, zero at the start)
        ks = tl.arange(0, BLOCK_T)
        for t0 in range(tl.program_id(0) * ROWS, n_tokens, tl.num_programs(0) * ROWS):
            toks = t0 + tl.arange(0, ROWS)
            live = toks < n_tokens
            rows = toks.to(tl.int64)
            ids = tl.load(ids_ptr + rows[:, None] * TOPK + ks[None, :],
                          mask=live[:, None] & (ks < TOPK)[None, :], other=-1)
            n_local = tl.sum(((ids >= 0) & (ids < n_experts)).to(tl.int32), 1)
            todo = (live & (n_local >= MIN_SUM)).to(tl.int32)
            base = tl.atomic_add(count_ptr, tl.sum(todo, 0))
            tl.store(list_ptr + base + tl.cumsum(todo, 0) - 1, toks, mask=todo != 0)
            zero = live & (n_local == 0)
            z = tl.zeros([ROWS, BLOCK_H], dtype=out_ptr.dtype.element_ty)
            for c0 in range(0, hidden, BLOCK_H):
                cols = c0 + tl.arange(0, BLOCK_H)
                tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], z,
                         mask=zero[:, None] & (cols < hidden)[None, :])


#: columns of one token per program of the top-k sum: its slots are a chain of dependent loads
#: (the ids, then each local slot's row behind a branch), so fewer, wider programs wait less.
#: On an H200 (``tests/gpu/probe_topk_sum.py``), against 1024: 0.90-0.94x the kernel's time
#: with 32 of 256 experts local from 16384 tokens, 0.99-1.01x with every expert local (there
#: at the copy bandwidth either way); 8-16 warps or 4096-8192 columns did no better
TOPK_SUM_BLOCK = 2048
#: programs per SM of the token scan (four warps each: they share the SMs with the GEMMs)
SCAN_PROGRAMS_PER_SM = 1
#: programs per SM of the listed top-k sum, over all its column blocks (four warps each)
LIST_PROGRAMS_PER_SM = 16
#: where :func:`start_token_scan` runs on CUDA by default: a side stream (else the caller's)
SCAN_ON_SIDE_STREAM = True
#: programs of the persistent kernels under Triton's interpreter (no GPU): a few, so that each
#: walks several blocks
_INTERPRETER_PROGRAMS = 3


@dataclass
class TokenScan:
    """What :func:`start_token_scan` started: the list of tokens to sum and its length on the
    device, and the event the caller's stream waits on before reading them (None: the scan ran
    on the caller's stream)."""

    tokens: torch.Tensor
    count: torch.Tensor
    done: torch.cuda.Event | None


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def start_token_scan(topk_ids: torch.Tensor, out: torch.Tensor, n_experts: int, sole: bool, *,
                     side: bool | None = None, rows: int = 16, block_h: int = 512,
                     programs_per_sm: int | None = None) -> TokenScan:
    """Write ``out``'s rows of the tokens with no local slot as zeros and list the tokens that
    need a sum (two or more local slots with ``sole``, else one or more). On CUDA with ``side``
    (default :data:`SCAN_ON_SIDE_STREAM`) this runs on a side stream that starts where the
    caller's stream is now: launch the GEMMs after it, and read the list with
    :func:`launch_topk_sum` (``scan=``), which makes the caller's stream wait for it.
    ``topk_ids`` (contiguous) must stay as it is until then."""
    m, topk = topk_ids.shape
    hidden = out.shape[1]
    if rows < 1 or rows & (rows - 1) or block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"rows and block_h must be powers of two (block_h >= 16), got {rows}, {block_h}")
    count = torch.zeros(1, dtype=torch.int32, device=out.device)
    tokens = torch.empty(max(1, m), dtype=torch.int32, device=out.device)
    per_sm = SCAN_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    grid = (max(1, min(cdiv(m, rows), _programs(out.device, per_sm))),)
    args = (topk_ids, out, tokens, count, m, n_experts, hidden)
    kwargs = dict(TOPK=topk, BLOCK_T=next_pow2(topk), ROWS=rows, BLOCK_H=block_h, MIN_SUM=2 if sole else 1,
                  num_warps=4)
    if not ((SCAN_ON_SIDE_STREAM if side is None else side) and out.is_cuda):
        launch(scan_tokens_kernel, grid, args, kwargs)
        return TokenScan(tokens, count, None)
    here = torch.cuda.current_stream(out.device)
    stream = _SIDE.get(out.device)
    if stream is None:
        stream = _SIDE[out.device] = torch.cuda.Stream(out.device)
    stream.wait_stream(here)
    with torch.cuda.stream(stream):
        launch(scan_tokens_kernel, grid, args, kwargs)
        done = torch.cuda.Event()
        done.record(stream)
    return TokenScan(tokens, count, done)


def launch_topk_sum(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out: torch.Tensor, n_experts: int, sole: bool = False, *, block: int | None = None,
                    num_warps: int = 4, scan: TokenScan | None = None,
                    programs_per_sm: int | None = None) -> None:
    """``out[m] = sum_s w[m, s] * y[m * topk + s]`` over the slots of local experts (``sole``:
    not for the tokens with one local slot, whose row :func:`launch_down` wrote). A program
    sums ``block`` columns of one token (default :data:`TOPK_SUM_BLOCK`, or the row's power of
    two where it is narrower) with ``num_warps`` warps. ``scan``: only the tokens it listed
    (:func:`start_token_scan` wrote the others' rows), by ``programs_per_sm`` programs per SM
    (default :data:`LIST_PROGRAMS_PER_SM`) over the column blocks."""
    m, topk = topk_ids.shape
    hidden = y.shape[1]
    block = _block(hidden, TOPK_SUM_BLOCK) if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    n_col = cdiv(hidden, block)
    if scan is None:
        launch(topk_sum_kernel, (m, n_col), (y, ids, tw, out, n_experts, hidden), dict(
            TOPK=topk, BLOCK=block, SOLE=sole, num_warps=num_warps))
        return
    if scan.done is not None:
        torch.cuda.current_stream(out.device).wait_event(scan.done)
    per_sm = LIST_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    programs = max(1, min(m, cdiv(_programs(out.device, per_sm), n_col)))
    launch(topk_sum_list_kernel, (programs, n_col), (y, ids, tw, out, scan.tokens, scan.count, n_experts,
                                                     hidden), dict(TOPK=topk, BLOCK=block,
                                                                   num_warps=num_warps))
