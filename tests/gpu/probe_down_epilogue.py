"""How much of the flat down kernel's time its epilogue costs: the library's kernel against copies
whose epilogue is cheaper, kernel alone, on the GPU host.

The copies (``down_epi_kernel``) walk the same map with the same tiles, loads and products and
differ only in what each tile does with its ``[BLOCK_M, BLOCK_N]`` result:

* ``scatter``: each row to its slot's row of ``y`` (the library's epilogue without the sole rows);
* ``tma``, ``tma2`` (three and two stages): the whole tile with one TMA store to rows
  ``pid_m * BLOCK_M ...`` of a padded buffer (one block of rows per row tile, so no tile writes
  another's rows: the layout a down GEMM would need to store its tiles whole, with an inverse
  permutation for the top-k sum to read);
* ``none``: one value per tile (the products still run; a lower bound of any epilogue).

``lib`` is the library's call (``fused_experts.launch_down``: the sole rows' weighting and
writes included, as the grid runs it at 32 local experts). Times: CUDA events, the variants'
calls alternating round by round behind a GPU sleep, median. The ``tma`` variant's rows are
checked against the library's ``y``.

    python3 tests/gpu/probe_down_epilogue.py [--json out.json] [--reps 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_experts import alternating_ms, down_probe_inputs, probe_shapes  # noqa: E402

from dbo.moe import fused_experts as fe  # noqa: E402
from dbo.moe.fused_maps import map_row_tile, map_tile  # noqa: E402
from dbo.moe.triton_launch import Desc, launch  # noqa: E402

SHAPES = [(256, 32, 16384), (256, 32, 65536), (256, 128, 16384), (256, 256, 16384), (256, 256, 65536),
          (768, 256, 16384), (2048, 256, 8192)]
#: name -> (EPI, stages, programs per SM: what fits, tests/gpu/compile_check.py down_epi_*): the
#: TMA store's staging buffer (32 KB) leaves one program per SM at three stages, two at two
EPILOGUES = {"scatter": (0, 3, 2), "tma": (1, 3, 1), "tma2": (1, 2, 2), "none": (2, 3, 2)}


@triton.jit
def down_epi_kernel(act_desc, order_ptr, map_ptr, w_desc, y_ptr, ypad_desc, hidden, inter,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI: tl.constexpr):
    # fused_kernels.down_flat_kernel's walk, loads and products, with another epilogue (EPI)
    n_col = tl.cdiv(hidden, BLOCK_N)
    n_m = tl.load(map_ptr)
    k_tiles = tl.cdiv(inter, BLOCK_K)
    for t in tl.range(tl.program_id(0), n_m * n_col, tl.num_programs(0), flatten=True):
        e, row0, end_row, pid_n = map_tile(t, map_ptr, n_col)
        w_row = e * hidden + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = act_desc.load([row0, ki * BLOCK_K])
            b = w_desc.load([w_row, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if EPI == 0:
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            slots = tl.load(order_ptr + rows, mask=rows < end_row, other=0).to(tl.int64)
            tl.store(y_ptr + slots[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(rows < end_row)[:, None] & (cols < hidden)[None, :])
        elif EPI == 1:
            # the tile's row tile of the map: its block of the padded buffer
            pid_m, _ = map_row_tile(t, map_ptr, n_col)
            ypad_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + t, tl.sum(tl.sum(acc, 1), 0).to(y_ptr.dtype.element_ty))


def one_shape(lim, inter: int, local: int, t: int, reps: int) -> dict:
    hidden, topk = 7168, 8
    case, order, offsets, down, act, persist, r = down_probe_inputs(lim, inter, local, t, hidden, topk)
    r["down"] = str(down)
    if not down.flat:
        r["skipped"] = "not the flat tile"
        return r
    bm, bn, bk = down.block_m, down.block_n, down.block_k
    pairs = t * topk
    ids, tw = case.ids.contiguous(), case.weights.contiguous()
    sole = fe.prefer_sole(int(case.counts.sum()) / pairs, topk)
    maps = fe.tile_map(offsets, bm, pairs, (order, ids) if sole else None)
    plain_map, _ = fe.tile_map(offsets, bm, pairs)
    bound = pairs // bm + local + 1
    y_lib = torch.zeros(pairs, hidden, dtype=case.x.dtype, device="cuda")
    out = torch.zeros(t, hidden, dtype=case.x.dtype, device="cuda")
    y = torch.zeros(pairs, hidden, dtype=case.x.dtype, device="cuda")
    ypad = torch.zeros(bound * bm, hidden, dtype=case.x.dtype, device="cuda")
    n_experts = case.w2.shape[0]
    a_desc = Desc(act, (bm, bk))
    w_desc = Desc(case.w2.view(n_experts * hidden, inter), (bn, bk))
    yp_desc = Desc(ypad, (bm, bn))
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    fns = {"lib": lambda: fe.launch_down(act, order, offsets, case.w2, y_lib, down, pairs, True,
                                         (ids, tw, out) if sole else None, maps)}
    for name, (epi, stages, per_sm) in EPILOGUES.items():
        fns[name] = lambda epi=epi, stages=stages, per_sm=per_sm: launch(down_epi_kernel, (per_sm * sms,), (
            a_desc, order, plain_map, w_desc, y, yp_desc, hidden, inter), dict(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EPI=epi, num_warps=down.num_warps, num_stages=stages))
    ms = alternating_ms(fns, reps, rotate=True)
    r.update({f"{k}_ms": v for k, v in ms.items()})
    # the tma variant's rows against the library's (without the sole rows: the plain launch)
    fns["tma2"]()
    y_chk = torch.zeros_like(y_lib)
    fe.launch_down(act, order, offsets, case.w2, y_chk, down, pairs, True, None, (plain_map, None))
    m = plain_map.cpu()
    n_tiles = int(m[0])
    ok = True
    for j in (0, n_tiles // 2, n_tiles - 1):
        row0, end_row = int(m[2 + 5 * j]), int(m[3 + 5 * j])
        rows = min(bm, end_row - row0)
        slots = order[row0:row0 + rows].long()
        ok &= bool(torch.equal(ypad[j * bm:j * bm + rows], y_chk[slots]))
    r["tma_same_rows"] = ok
    r["sole"] = sole
    return r


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"I={r['I']} L={r['L']} T={r['T']}: {r['skipped']} ({r['down']})"
    lib = r["lib_ms"]
    return (f"I={r['I']} L={r['L']} T={r['T']} (sole {r['sole']}): lib {lib:.3f} ms "
            f"({lib / r['limit_ms']:.2f}x own limit) | "
            + " ".join(f"{k} {r[f'{k}_ms'] / lib:.3f}" for k in EPILOGUES)
            + f" of lib | tma rows equal: {r['tma_same_rows']}")


if __name__ == "__main__":
    sys.exit(probe_shapes(SHAPES, one_shape, _line, limits=True))
