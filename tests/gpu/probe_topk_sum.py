"""The top-k sum's program size on the GPU host: ``launch_topk_sum`` with a program per token and
``block`` columns (the library: ``TOPK_SUM_BLOCK`` = 2048 columns, four warps, four programs per
token at hidden 7168; 1024 before) against other sizes, each timed alone (median of back-to-back
launches), same run, same inputs, and each output checked bit for bit against the library's.

A program's local slots are a chain of dependent steps (the ids, then each slot's row behind a
branch), so with many small programs the kernel waits on latency rather than on bandwidth; fewer,
wider programs issue a slot's whole row at once. ``tokens`` (``rows_kernel`` here): a program
sums ``TOKENS`` tokens at once, a slot's rows loaded where any of its tokens has it local (fewer
programs where most tokens have one local slot or none). On an H200 those were 1.15-4.7x the
library's time (docs/perf_notes.md section 5k): the masks and reductions over a block of tokens
cost more than the programs they save.

    python3 tests/gpu/probe_topk_sum.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import median_ms  # noqa: E402

from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402

SHAPES = [(32, 4096), (32, 16384), (32, 65536), (128, 16384), (256, 4096), (256, 16384), (256, 65536)]
#: (block, warps, tokens per program: 0 the library's kernel); the first is the library's
#: (TOPK_SUM_BLOCK; 1024 before)
VARIANTS = [(2048, 4, 0), (1024, 4, 0), (4096, 8, 0), (2048, 4, 2), (2048, 4, 4), (2048, 8, 4),
            (1024, 4, 8), (2048, 8, 8)]


@triton.jit
def rows_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, m, n_experts, hidden, TOPK: tl.constexpr,
                BLOCK: tl.constexpr, TOKENS: tl.constexpr, SOLE: tl.constexpr):
    # TOKENS tokens x BLOCK columns; the top-k sum's arithmetic (acc + w * y per local slot, in
    # slot order), each slot skipped where none of the tokens has it local
    toks = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    live = toks < m
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < hidden
    n_local = tl.zeros([TOKENS], dtype=tl.int32)
    for s in tl.static_range(TOPK):
        e = tl.load(ids_ptr + toks * TOPK + s, mask=live, other=-1)
        n_local += ((e >= 0) & (e < n_experts)).to(tl.int32)
    todo = live & (n_local != 1) if SOLE else live
    if tl.sum(todo.to(tl.int32), 0) > 0:
        acc = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
        for s in tl.static_range(TOPK):
            e = tl.load(ids_ptr + toks * TOPK + s, mask=todo, other=-1)
            loc = todo & (e >= 0) & (e < n_experts)
            if tl.sum(loc.to(tl.int32), 0) > 0:
                w = tl.load(w_ptr + toks * TOPK + s, mask=loc, other=0.0).to(tl.float32)
                v = tl.load(y_ptr + (toks * TOPK + s)[:, None] * hidden + cols[None, :],
                            mask=loc[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
                acc = tl.where(loc[:, None], acc + w[:, None] * v, acc)
        tl.store(out_ptr + toks[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=todo[:, None] & col_mask[None, :])


def one_shape(lim, local: int, t: int, hidden: int, reps: int) -> dict:
    topk = 8
    g = torch.Generator(device="cuda").manual_seed(t + local)
    tw, ids = torch.topk(torch.softmax(torch.randn(t, 256, device="cuda", generator=g), -1), topk)
    ids = torch.where(ids < local, ids, -1).to(torch.int32)
    y = torch.randn(t * topk, hidden, device="cuda", generator=g).bfloat16()
    n_local = (ids >= 0).sum(1)
    rows = {}
    for sole in (False, True) if local < 128 else (False,):
        busy = n_local != 1 if sole else torch.ones_like(n_local, dtype=torch.bool)
        # bytes: the local rows of the tokens it sums, read; the tokens it writes
        nbytes = (int(n_local[busy].sum()) + int(busy.sum())) * hidden * 2
        ref, ms = None, {}
        for block, warps, tokens in VARIANTS:
            out = torch.full((t, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run(b=block, w=warps, n=tokens, o=out, s=sole):
                if n:
                    grid = (fe.cdiv(t, n), fe.cdiv(hidden, b))
                    rows_kernel[grid](y, ids, tw, o, t, local, hidden, TOPK=topk, BLOCK=b, TOKENS=n, SOLE=s,
                                      num_warps=w)
                else:
                    fe.launch_topk_sum(y, ids, tw, o, local, s, block=b, num_warps=w)
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = out
            else:
                same = torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))
                assert same, (block, warps, tokens)
            ms[f"{block}/{warps}" + f"x{tokens}" * bool(tokens)] = sorted(
                median_ms(run, 20) for _ in range(reps))[reps // 2]
        base = ms[f"{VARIANTS[0][0]}/{VARIANTS[0][1]}"]
        print(f"L={local:>3} T={t:>5} sole={sole:d} | library {base * 1e3:.1f} us "
              f"({nbytes / base / 1e9:.2f} TB/s, limit {lim.copy_gbps / 1e3:.2f}) | " + " ".join(
                  f"{k} {v / base:.3f}" for k, v in ms.items()), flush=True)
        rows[f"sole={sole}"] = {"ms": ms, "bytes": nbytes}
    return {"L": local, "T": t, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    with torch.inference_mode():
        rows = [one_shape(lim, loc, t, 7168, a.reps) for loc, t in SHAPES]
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
