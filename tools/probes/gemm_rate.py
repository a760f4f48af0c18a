"""What rate a grouped GEMM of the experts' shapes can reach on this GPU, and with which kernel.

For the flops-bound experts rows (hundreds of rows per expert) the library's grouped GEMMs run
at 60-70% of the rate of one large cuBLAS GEMM. This probe times, on the experts' shapes with
uniform rows per expert (every expert R rows; no routing):

* cuBLAS: one large ``torch.mm`` (the limit's rate) and ``torch.bmm`` over the experts (a
  strided-batched GEMM: what a grouped GEMM could reach with equal groups);
* ``torch._grouped_mm`` (CUTLASS) where it exists;
* a Triton grouped GEMM with TMA loads for both operands, with and without
  ``tl.range(..., warp_specialize=True)``, and a persistent variant;
* the library's fused gate/up and down kernels (``launch_gate_up``/``launch_down``) on the
  same rows.

    python3 tools/probes/gemm_rate.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tune_experts import median_ms  # noqa: E402


@triton.jit
def _grouped_tma(a_desc, b_desc, c_desc, rows_per_group, n, k, num_tiles,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 WS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr):
    # C[g*R + r, :] = A[g*R + r, :] @ B[g*N:(g+1)*N, :].T for every group g (R % BM == 0)
    m_tiles = rows_per_group // BM
    n_tiles = tl.cdiv(n, BN)
    per_group = m_tiles * n_tiles
    start = tl.program_id(0)
    step = NUM_SMS if PERSISTENT else num_tiles
    for tile in tl.range(start, num_tiles, step, flatten=False):
        g = tile // per_group
        local = tile % per_group
        width = GROUP_M * n_tiles
        first_m = (local // width) * GROUP_M
        size_m = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (local % width) % size_m
        pid_n = (local % width) // size_m
        row = g * rows_per_group + pid_m * BM
        col = g * n + pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in tl.range(0, k, BK, warp_specialize=WS):
            a = a_desc.load([row, k0])
            b = b_desc.load([col, k0])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([row, pid_n * BN], acc.to(tl.bfloat16))


def grouped_tma(a, b, c, groups, rows, n, k, cfg, ws, persistent, sms):
    bm, bn, bk, gm, warps, stages = cfg
    a_d = TensorDescriptor.from_tensor(a, [bm, bk])
    b_d = TensorDescriptor.from_tensor(b, [bn, bk])
    c_d = TensorDescriptor.from_tensor(c, [bm, bn])
    tiles = groups * (rows // bm) * triton.cdiv(n, bn)
    grid = (min(tiles, sms),) if persistent else (tiles,)
    _grouped_tma[grid](a_d, b_d, c_d, rows, n, k, tiles, BM=bm, BN=bn, BK=bk, GROUP_M=gm, WS=ws,
                       PERSISTENT=persistent, NUM_SMS=sms, num_warps=warps, num_stages=stages)


def probe_shape(name, groups, rows, n, k, configs, peak, sms, steps) -> dict:
    dev, bf = torch.device("cuda"), torch.bfloat16
    flops = 2.0 * groups * rows * n * k
    A = torch.randn(groups * rows, k, device=dev, dtype=bf) / k ** 0.5
    B = torch.randn(groups * n, k, device=dev, dtype=bf) / k ** 0.5
    C = torch.empty(groups * rows, n, device=dev, dtype=bf)
    Bt = B.view(groups, n, k).transpose(1, 2)
    ref = torch.bmm(A.view(groups, rows, k), Bt).reshape_as(C).float()
    res: dict[str, float] = {}

    def rate(fn, label) -> bool:
        try:
            fn()
            torch.cuda.synchronize()
            t = median_ms(fn, steps)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a finding
            print(f"  {label}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return False
        res[label] = flops / t / 1e9
        print(f"  {label}: {t:.3f} ms, {res[label]:.0f} TFLOP/s, {res[label] / peak:.2f} of mm", flush=True)
        return True

    print(f"{name}: {groups} groups x {rows} rows, N={n}, K={k}", flush=True)
    rate(lambda: torch.bmm(A.view(groups, rows, k), Bt), "cublas bmm")
    if hasattr(torch, "_grouped_mm"):
        offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * rows
        rate(lambda: torch._grouped_mm(A, Bt, offs=offs), "torch._grouped_mm")
    for cfg in configs:
        for ws in (False, True):
            for pers in (False, True):
                label = f"triton tma {cfg} ws={int(ws)} persistent={int(pers)}"
                C.zero_()
                ok = rate(lambda cfg=cfg, ws=ws, pers=pers: grouped_tma(A, B, C, groups, rows, n, k, cfg,
                                                                        ws, pers, sms), label)
                if ok:
                    err = ((C.float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        print(f"  {label}: WRONG, rel err {err:.2e}", flush=True)
                        res.pop(label)
    return dict(name=name, groups=groups, rows=rows, n=n, k=k, tflops=res)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two shapes, two tiles")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: dict = {"device": torch.cuda.get_device_name(dev), "triton": triton.__version__, "rows": []}
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / median_ms(lambda: torch.mm(a, b), args.steps) / 1e9
    out["mm_8192_tflops"] = peak
    print(f"{out['device']}, triton {triton.__version__}: torch.mm 8192^3 {peak:.0f} TFLOP/s", flush=True)
    configs = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 4),
               (64, 256, 64, 8, 4, 4), (128, 128, 64, 8, 4, 4)]
    # (groups, rows per group, N, K): gate/up (N = 2I) and down (N = hidden) of I=2048 and 768
    shapes = [("up I=2048", 256, 512, 4096, 7168), ("down I=2048", 256, 512, 7168, 2048),
              ("up I=2048", 256, 256, 4096, 7168), ("down I=2048", 256, 256, 7168, 2048),
              ("up I=768", 256, 512, 1536, 7168), ("down I=768", 256, 512, 7168, 768),
              ("up I=2048", 32, 2048, 4096, 7168)]
    if args.quick:
        configs, shapes = configs[:2], shapes[:2]
    for shape in shapes:
        out["rows"].append(probe_shape(*shape, configs, peak, sms, args.steps))
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
