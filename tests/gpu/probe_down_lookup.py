"""Where the flat down GEMM's time goes at short K, on the GPU host: the library's
``down_flat_kernel`` against copies of it that change one thing each, same run, same inputs.

* ``lookup``: how a program finds its tile's expert and rows. ``scan`` (the library): five
  block-wide reductions over the experts' tile ends per tile (``_tile_at``); ``table``: three
  scalar loads from a table of row tiles (expert, first row, end row) built beforehand (here by
  torch, untimed).
* ``prefetch``: the rows' slots (``order``) loaded at the tile's start, under its products,
  rather than after them.
* ``store``: ``scatter`` (the library: each row to its slot) or ``sorted`` (each row to its
  sorted row: contiguous tiles; the output is then compared through the order).

    python3 tests/gpu/probe_down_lookup.py [--json out.json]

Each variant's output is compared with the library's bit for bit before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import median_ms  # noqa: E402

from dbo.bench.experts import make_case  # noqa: E402
from dbo.bench.limits import measure_device_limits  # noqa: E402
from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe.fused_kernels import _tile_at, _tile_table  # noqa: E402
from dbo.moe.fused_tiles import FLAT_DOWN  # noqa: E402

SHAPES = [(256, 32, 8192), (256, 32, 16384), (256, 32, 65536), (256, 128, 16384), (256, 256, 8192),
          (256, 256, 16384), (256, 256, 65536), (768, 256, 16384), (2048, 256, 8192)]
#: (name, lookup table, prefetch the slots, sorted stores)
VARIANTS = [("probe copy", False, False, False), ("prefetch", False, True, False),
            ("table", True, False, False), ("table+prefetch", True, True, False),
            ("table+prefetch+sorted", True, True, True)]


@triton.jit
def down_probe_kernel(act_desc, order_ptr, offs_ptr, tmap_ptr, n_mt_ptr, w_desc, y_ptr, n_experts, hidden,
                      inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, TABLE: tl.constexpr,
                      PREFETCH: tl.constexpr, SORTED: tl.constexpr):
    n_col = tl.cdiv(hidden, BLOCK_N)
    if TABLE:
        n_m = tl.load(n_mt_ptr)
        n_tiles = n_m * n_col
    else:
        starts, ends, m_tiles, tile_ends, n_tiles = _tile_table(offs_ptr, n_experts, n_col, BLOCK_M, BLOCK_E)
    k_tiles = tl.cdiv(inter, BLOCK_K)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
        if TABLE:
            group = GROUP_M * n_col
            first_m = (t // group) * GROUP_M
            size_m = tl.minimum(n_m - first_m, GROUP_M)
            pid_m = first_m + (t % group) % size_m
            pid_n = (t % group) // size_m
            e = tl.load(tmap_ptr + 3 * pid_m)
            row0 = tl.load(tmap_ptr + 3 * pid_m + 1)
            end_row = tl.load(tmap_ptr + 3 * pid_m + 2)
        else:
            e, row0, end_row, pid_n = _tile_at(t, starts, ends, m_tiles, tile_ends, n_col, BLOCK_M, BLOCK_E,
                                               GROUP_M)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        if PREFETCH:
            if SORTED:
                slots = rows.to(tl.int64)
            else:
                slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        w_row = e * hidden + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = act_desc.load([row0, ki * BLOCK_K])
            b = w_desc.load([w_row, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if not PREFETCH:
            if SORTED:
                slots = rows.to(tl.int64)
            else:
                slots = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cols < hidden)[None, :])


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
    res = {"I": inter, "L": local, "T": t, "pairs": pairs, "limit_ms": own, "library_ms": median_ms(lib, reps)}
    table, n_m = tile_map(offsets, cfg.block_m)
    a_desc = TensorDescriptor.from_tensor(act, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(case.w2.view(local * hidden, inter), [cfg.block_n, cfg.block_k])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sorted_ref = torch.zeros(t * topk, hidden, dtype=case.x.dtype, device="cuda")
    valid = order[:pairs].long()
    sorted_ref[:pairs] = y_ref[valid]
    for name, tab, pre, srt in VARIANTS:
        y = torch.zeros_like(y_ref)

        def run(yy: torch.Tensor = y, tab: bool = tab, pre: bool = pre, srt: bool = srt) -> None:
            down_probe_kernel[(2 * sms,)](a_desc, order, offsets, table, n_m, w_desc, yy, local, hidden, inter,
                                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                          BLOCK_E=max(16, triton.next_power_of_2(local)),
                                          GROUP_M=cfg.group_m, TABLE=tab, PREFETCH=pre, SORTED=srt,
                                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        run()
        torch.cuda.synchronize()
        ref = sorted_ref if srt else y_ref
        same = bool(torch.equal(y[:pairs] if srt else y, ref[:pairs] if srt else ref))
        res[name + "_ms"] = median_ms(run, reps) if same else float("nan")
        res[name + "_equal"] = same
    print(f"I={inter} L={local} T={t} pairs={pairs} own limit {own:.3f} ms: library {res['library_ms']:.3f} "
          f"({res['library_ms'] / own:.2f}x)" + "".join(
              f"; {n} {res[n + '_ms']:.3f} ({res[n + '_ms'] / res['library_ms']:.3f})"
              + ("" if res[n + "_equal"] else " WRONG") for n, *_ in VARIANTS), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    lim = measure_device_limits()
    print(lim.describe(), flush=True)
    rows = []
    with torch.inference_mode():
        for inter, local, t in SHAPES:
            rows.append(one_shape(lim, inter, local, t, a.reps))
    if a.json:
        Path(a.json).write_text(json.dumps({"limits": lim.as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
