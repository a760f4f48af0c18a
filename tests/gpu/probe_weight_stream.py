"""How fast a grouped GEMM's weight tiles stream from HBM, by the weights' layout in memory.

Up to ~128 rows per expert the experts' limit is the weights' bytes, and at 128 rows the
library's GEMMs move them at 69-77% of the copy bandwidth (at I=2048, 256 local experts, T=4096
the gate/up GEMM its 15 GB at ~3.3 TB/s, the down GEMM its 7.5 GB at ~3.0). A weight tile
``[BN, BK]`` of a row-major ``[N, K]`` matrix is ``BN`` runs of ``2 * BK`` bytes, 2 * K bytes
apart: does that layout cost bandwidth? This probe times a GEMM-shaped kernel that streams every
weight tile once against a small, L2-resident activation tile (the bytes-bound case), for:

* ``nk``: the library's layout, ``w[e]`` as ``[N, K]`` (box ``[BN, BK]`` at ``(e * N + n, k)``);
* ``packed``: the same tiles stored one after the other, each ``BN * BK`` contiguous elements,
  the K steps of one column block adjacent (``[E, N / BN, K / BK, BN, BK]``);

with one program per tile or persistent programs, and prints each variant's GB/s over the copy
bandwidth measured in the same run (read + written, the limit's). Each tile's product goes to a
small scratch output (``t % 1024``), so that the stores stay a small share of the bytes; the
kernels' numbers are checked first on a small case (:func:`check`; ``check("cpu")`` under
``TRITON_INTERPRET=1``).

    python3 tests/gpu/probe_weight_stream.py [--json OUT]

On an H200 (docs/perf_notes.md section 5q) the contiguous tiles streamed 2-6% faster at 64-row
tiles and 0-3% at the flat down kernel's 128-row tile: the layout is a small part of the gap at
128 rows per expert; most of it is the row tiles' padding (rows past each expert's end).
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

from tune_experts import alternating_ms  # noqa: E402

from dbo.bench.limits import measure_device_limits  # noqa: E402


@triton.jit
def _stream(a_desc, w_desc, out_ptr, n_experts, n, k,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr,
            STAGES: tl.constexpr):
    # every (expert, column block) tile: acc = a @ w_tile.T over the K steps, stored to out
    nb = n // BN
    kb = k // BK
    total = n_experts * nb
    for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=True, num_stages=STAGES):
        e = t // nb
        pid_n = t % nb
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for ki in range(kb):
            a = a_desc.load([0, ki * BK])
            if PACKED:  # noqa: SIM108 (a Triton constexpr branch)
                b = w_desc.load([(t * kb + ki) * BN, 0])
            else:
                b = w_desc.load([e * n + pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        tl.store(out_ptr + (t % 1024) * BM * BN + rows[:, None] * BN + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty))


def pack(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``w`` ``[E, N, K]`` as ``[E * N/bn * K/bk * bn, bk]``: tile (e, n, k) at rows
    ``((e * N/bn + n) * K/bk + k) * bn``."""
    e, n, k = w.shape
    return w.view(e, n // bn, bn, k // bk, bk).permute(0, 1, 3, 2, 4).contiguous().view(-1, bk)


def stream_call(w: torch.Tensor, packed: torch.Tensor, a: torch.Tensor, *, bn: int, bk: int, warps: int,
                stages: int, programs: int | None, use_packed: bool):
    e, n, k = w.shape
    bm = a.shape[0]
    out = torch.empty(1024 * bm * bn, device=w.device, dtype=w.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = (TensorDescriptor.from_tensor(packed, [bn, bk]) if use_packed
              else TensorDescriptor.from_tensor(w.view(e * n, k), [bn, bk]))
    grid = (programs or e * (n // bn),)

    def call():
        _stream[grid](a_desc, w_desc, out, e, n, k, BM=bm, BN=bn, BK=bk, PACKED=use_packed, STAGES=stages,
                      num_warps=warps, num_stages=stages)
    return call, out


def check(device: str = "cuda") -> None:
    """Both layouts' kernels against torch on a small case (each tile's product lands in ``out``
    only while there are at most 1024 tiles: the timed runs overwrite their slots)."""
    e, n, k = 2, 256, 128
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 dot)
    w = torch.randn(e, n, k, device=device).to(dtype)
    a = torch.randn(64, k, device=device).to(dtype)
    want = torch.einsum("mk,enk->enm", a.float(), w.float())
    for bn, bk in ((128, 64), (128, 128)):
        for use_packed in (False, True):
            call, out = stream_call(w, pack(w, bn, bk), a, bn=bn, bk=bk, warps=4, stages=2, programs=None,
                                    use_packed=use_packed)
            call()
            got = out.view(1024, 64, bn)[: e * n // bn].float()
            ref = want.view(e, n // bn, bn, 64).permute(0, 1, 3, 2).reshape(-1, 64, bn)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                raise AssertionError(f"bn={bn} bk={bk} packed={use_packed}: relative error {err}")


def one_shape(name: str, e: int, n: int, k: int, sms: int, copy_gbps: float, steps: int) -> list[dict]:
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    variants = {}
    acts = {bm: torch.randn(bm, k, device="cuda").to(w.dtype) for bm in (64, 128)}
    for bn, bk in ((128, 64), (256, 64), (128, 128)):
        packed = pack(w, bn, bk)
        for bm, warps, stages, per_sm in ((64, 4, 4, 2), (128, 4, 3, 2), (128, 8, 4, 1)):
            if bn == 256 and bm == 128 and warps == 4:
                continue
            if bk == 128 and stages > 3:
                stages = 3
            for persistent in (False, True):
                for use_packed in (False, True):
                    key = (f"bn{bn} bk{bk} bm{bm} w{warps} s{stages} {'pers' if persistent else 'grid'} "
                           f"{'packed' if use_packed else 'nk'}")
                    call, _ = stream_call(w, packed, acts[bm], bn=bn, bk=bk, warps=warps, stages=stages,
                                            programs=per_sm * sms if persistent else None,
                                            use_packed=use_packed)
                    variants[key] = call
        del packed
    try:
        times = alternating_ms(variants, steps, rotate=True)
    except triton.runtime.errors.OutOfResources as err:
        print(f"{name}: out of resources: {err}", flush=True)
        return rows
    wbytes = w.numel() * w.element_size()
    for key, ms in sorted(times.items(), key=lambda kv: kv[1]):
        gbps = wbytes / (ms * 1e-3) / 1e9
        rows.append(dict(shape=name, variant=key, ms=ms, gbps=gbps, x_copy=gbps / copy_gbps))
        print(f"{name:<14} {key:<40} {ms:8.3f} ms {gbps:7.0f} GB/s {gbps / copy_gbps:5.2f} x copy",
              flush=True)
    del w
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args()
    check()
    lim = measure_device_limits()
    print(lim.describe(), f"({lim.copy_gbps:.0f} GB/s, {lim.gemm_tflops:.0f} TFLOP/s)", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    # (name, experts, N, K): the gate/up weights (N = 2I) and the down weights (N = hidden)
    for name, e, n, k in (("up I=2048", 64, 4096, 7168), ("down I=2048", 128, 7168, 2048),
                          ("up I=768", 128, 1536, 7168), ("down I=768", 256, 7168, 768),
                          ("up I=256", 256, 512, 7168), ("down I=256", 256, 7168, 256)):
        rows += one_shape(name, e, n, k, sms, lim.copy_gbps, a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(limits=lim.as_dict(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
