"""Where the flat down GEMM's time goes at short K, on the GPU host: the library's
``down_flat_kernel`` against copies of it that change one thing each, same run, same inputs.
(Written when the library's kernel scanned the experts per tile; the library has since taken the
table: ``probe copy`` is the scan now, and ``table`` the library's lookup.)

* ``lookup``: how a program finds its tile's expert and rows. ``scan`` (``probe copy``): five
  block-wide reductions over the experts' tile ends per tile (``_tile_at``); ``table``: three
  scalar loads from a table of row tiles (expert, first row, end row) built beforehand (here by
  torch, untimed).
  ``reduce1``: the same values from one reduction of five operands.
* ``store``: to each row's slot (the library), or to its sorted row (contiguous tiles; the output
  is then compared through the order), with pointers or (``STORE=2``) a TMA store for the tiles
  whose rows are all the expert's (Triton 3.6 fails to compile that branch in the flattened
  loop: ``TritonGPUFuseNestedLoops``). Loading the slots at the tile's start, under its
  products, was slower: 1.02-1.49x.

    python3 tests/gpu/probe_down_lookup.py [--json out.json]

Each variant's output is compared with the library's bit for bit before it is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import median_ms, probe_shapes  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe.fused_kernels import _grouped_tile, _tile_at, _tile_table  # noqa: E402
from dbo.moe.fused_tiles import FLAT_DOWN  # noqa: E402

SHAPES = [(256, 32, 8192), (256, 32, 16384), (256, 32, 65536), (256, 128, 16384), (256, 256, 8192),
          (256, 256, 16384), (256, 256, 65536), (768, 256, 16384), (2048, 256, 8192)]
#: (name, lookup: 0 the library's scan, 1 one reduction, 2 a table; stores: 0 to each row's slot,
#: 1 to its sorted row, 2 sorted with a TMA store for the tiles whose rows are all the expert's)
VARIANTS = [("probe copy", 0, 0), ("reduce1", 1, 0), ("table", 2, 0), ("reduce1+sorted", 1, 1),
            ("table+sorted", 2, 1)]


@triton.jit
def _combine(c0, a0, b0, d0, f0, c1, a1, b1, d1, f1):
    return c0 + c1, tl.maximum(a0, a1), tl.maximum(b0, b1), tl.minimum(d0, d1), tl.minimum(f0, f1)


@triton.jit
def _tile_at1(t, ends, tile_ends, n_col_blocks, GROUP_M: tl.constexpr):
    # the expert of tile t and its rows and tiles in one reduction: the experts whose tiles end
    # at or before t come first (tile_ends and ends do not decrease), so e is their count, its
    # first tile and row their largest tile end and end row, its end tile and end row the
    # smallest of the others' (the padding lanes' tile ends are int32 max)
    big = 2147483647
    before = tile_ends <= t
    after_ends = tl.where(before | (tile_ends == big), big, ends)
    e, first_tile, first_row, end_row, end_tile = tl.reduce(
        (before.to(tl.int32), tl.where(before, tile_ends, 0), tl.where(before, ends, 0), after_ends,
         tl.where(before, big, tile_ends)), 0, _combine)
    pid_m, pid_n = _grouped_tile(t - first_tile, (end_tile - first_tile) // n_col_blocks, n_col_blocks,
                                 GROUP_M)
    return e, first_row, end_row, pid_m, pid_n


@triton.jit
def down_probe_kernel(act_desc, order_ptr, offs_ptr, tmap_ptr, n_mt_ptr, w_desc, y_ptr, y_desc, n_experts,
                      hidden, inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, LOOKUP: tl.constexpr,
                      STORE: tl.constexpr):
    n_col = tl.cdiv(hidden, BLOCK_N)
    if LOOKUP == 2:
        n_m = tl.load(n_mt_ptr)
        n_tiles = n_m * n_col
    else:
        starts, ends, m_tiles, tile_ends, n_tiles = _tile_table(offs_ptr, n_experts, n_col, BLOCK_M, BLOCK_E)
    k_tiles = tl.cdiv(inter, BLOCK_K)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
        if LOOKUP == 2:
            pid_m, pid_n = _grouped_tile(t, n_m, n_col, GROUP_M)
            e = tl.load(tmap_ptr + 3 * pid_m)
            row0 = tl.load(tmap_ptr + 3 * pid_m + 1)
            end_row = tl.load(tmap_ptr + 3 * pid_m + 2)
        elif LOOKUP == 1:
            e, first_row, end_row, pid_m, pid_n = _tile_at1(t, ends, tile_ends, n_col, GROUP_M)
            row0 = first_row + pid_m * BLOCK_M
        else:
            e, row0, end_row, pid_n = _tile_at(t, starts, ends, m_tiles, tile_ends, n_col, BLOCK_M, BLOCK_E,
                                               GROUP_M)
        w_row = e * hidden + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = act_desc.load([row0, ki * BLOCK_K])
            b = w_desc.load([w_row, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if STORE == 0:
            slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols < hidden)[None, :])
        elif STORE == 1:
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < hidden)[None, :])
        else:
            if end_row - row0 >= BLOCK_M:
                y_desc.store([row0, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))
            else:
                tl.store(y_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
                         acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < hidden)[None, :])


def loop_ms(fn, n: int) -> float:
    """Milliseconds per call of ``n`` calls back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def tile_map(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_m, 3] int32 (expert, first row, end row) of every row tile, and n_m as a device int."""
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    m_tiles = (ends - starts + block_m - 1) // block_m
    e = torch.repeat_interleave(torch.arange(len(ends), device=ends.device), m_tiles)
    first = torch.cumsum(m_tiles, 0) - m_tiles
    j = torch.arange(len(e), device=ends.device) - first[e]
    table = torch.stack([e, starts[e] + j * block_m, ends[e]], 1).to(torch.int32).contiguous()
    return table, torch.tensor([len(e)], dtype=torch.int32, device=ends.device)


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case = make_case(t, hidden, inter, local, seed=t)
    pairs = int(case.counts.sum())
    active = int((case.counts > 0).sum())
    est = t * topk / 256
    order, offsets = fe.route_order(case.ids, local)
    up, _ = fe.pick_configs(est, inter, local)
    cfg = FLAT_DOWN
    act = torch.empty(t * topk + cfg.block_m, inter, dtype=case.x.dtype, device="cuda").normal_()
    persist = fe.prefer_persistent(est, t * topk, local)
    fe.launch_gate_up(case.x, order, offsets, case.w1, act, up, t * topk, topk, persist)
    y_ref = torch.zeros(t * topk, hidden, dtype=case.x.dtype, device="cuda")

    def lib() -> None:
        fe.launch_down(act, order, offsets, case.w2, y_ref, cfg, t * topk, True)

    lib()
    torch.cuda.synchronize()
    own = lim.time_ms(2.0 * pairs * hidden * inter,
                      active * hidden * inter * 2 + pairs * inter * 2 + pairs * hidden * 2)
    res = {"I": inter, "L": local, "T": t, "pairs": pairs, "limit_ms": own}
    table, n_m = tile_map(offsets, cfg.block_m)
    a_desc = TensorDescriptor.from_tensor(act, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(case.w2.view(local * hidden, inter), [cfg.block_n, cfg.block_k])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sorted_ref = torch.zeros(t * topk, hidden, dtype=case.x.dtype, device="cuda")
    valid = order[:pairs].long()
    sorted_ref[:pairs] = y_ref[valid]
    y_desc = None
    fns = {}
    for name, lookup, store in VARIANTS:
        y = torch.zeros_like(y_ref)
        y_desc = TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n])

        def run(yy: torch.Tensor = y, yd=y_desc, lk: int = lookup, st: int = store) -> None:
            down_probe_kernel[(2 * sms,)](a_desc, order, offsets, table, n_m, w_desc, yy, yd, local, hidden,
                                          inter, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                          BLOCK_K=cfg.block_k, BLOCK_E=max(16, triton.next_power_of_2(local)),
                                          GROUP_M=cfg.group_m, LOOKUP=lk, STORE=st,
                                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        run()
        torch.cuda.synchronize()
        same = bool(torch.equal(y[:pairs], sorted_ref[:pairs]) if store else torch.equal(y, y_ref))
        res[name + "_equal"] = same
        if same:
            fns[name] = run
    # rounds, each variant in turn, so that the GPU's clocks drift alike for all; each time is
    # a loop of back-to-back calls of at least 30 ms between two events, over its calls
    every = {"library": lib, **fns}
    n_calls = {n: max(3, int(30 / median_ms(f, 3))) for n, f in every.items()}
    times: dict[str, list[float]] = {n: [] for n in every}
    for _ in range(reps):
        for n, f in every.items():
            times[n].append(loop_ms(f, n_calls[n]))
    for n in every:
        res[("library" if n == "library" else n) + "_ms"] = sorted(times[n])[len(times[n]) // 2]
        res[n + "_spread"] = (max(times[n]) - min(times[n])) / min(times[n])
    for name, *_ in VARIANTS:
        res.setdefault(name + "_ms", float("nan"))
    print(f"I={inter} L={local} T={t} pairs={pairs} own limit {own:.3f} ms: library {res['library_ms']:.3f} "
          f"({res['library_ms'] / own:.2f}x, spread {res['library_spread']:.2f})" + "".join(
              f"; {n} {res[n + '_ms']:.3f} ({res[n + '_ms'] / res['library_ms']:.3f})"
              + ("" if res[n + "_equal"] else " WRONG") for n, *_ in VARIANTS), flush=True)
    return res


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, reps=5, limits=True))
