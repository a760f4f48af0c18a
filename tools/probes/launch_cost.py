"""Host cost of one kernel launch on the GPU host: a Triton launch through ``kernel[grid](...)``,
the same with a TMA descriptor argument, the compiled kernel's launcher called directly, and a
few torch calls, each timed on the host while the GPU is kept busy (no launch waits).

    python3 tools/probes/launch_cost.py

The experts' small shapes are launch-bound (docs/performance.md): this says how much
of an ``apply``'s host time a launch costs, and what a direct launch would save.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _touch(x_ptr, n, A: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + A, mask=offs < n)


@triton.jit
def _touch_desc(x_ptr, d, n, BLOCK: tl.constexpr):
    v = d.load([0, 0])
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.sum(v, 0).to(tl.float32), mask=offs < n)


def _busy() -> None:
    a = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        a @ a


def per_call_us(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        _busy()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def main() -> None:
    x = torch.zeros(4096, device="cuda")
    w = torch.zeros(1024, 64, device="cuda", dtype=torch.bfloat16)
    compiled = _touch[(4,)](x, 4096, A=1.0, BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    rows = {
        "torch.empty 1 MB": lambda: torch.empty(1 << 19, device="cuda", dtype=torch.bfloat16),
        "x.add_(1)": lambda: x.add_(1),
        "triton kernel[grid](...)": lambda: _touch[(4,)](x, 4096, A=1.0, BLOCK=1024),
        "triton + TensorDescriptor.from_tensor": lambda: _touch_desc[(1,)](
            x, TensorDescriptor.from_tensor(w, [16, 64]), 64, BLOCK=64),
        "TensorDescriptor.from_tensor alone": lambda: TensorDescriptor.from_tensor(w, [16, 64]),
    }
    try:  # Triton 3.x's launcher, called as JITFunction.run calls it
        compiled.run(4, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     x, 4096, 1.0, 1024)
        torch.cuda.synchronize()
        rows["compiled.run (direct)"] = lambda: compiled.run(
            4, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
            x, 4096, 1.0, 1024)
    except Exception as e:  # noqa: BLE001 - a probe: say what the launcher took
        print(f"compiled.run direct: {type(e).__name__}: {e}")
    for name, fn in rows.items():
        print(f"{name:<42} {per_call_us(fn):7.1f} us per call", flush=True)
    experts_steps()


def experts_steps(tokens: int = 1024, inter: int = 256, local: int = 32) -> None:
    """Host time of each step of the fused experts at a launch-bound shape (50 calls in a row
    behind queued GEMMs), with the launcher called directly and through ``kernel[grid]``."""
    from experts_host import fused_steps

    from dbo.bench.experts.command import apply_experts, make_case
    from dbo.experts import SwiGLUExperts
    from dbo.experts.kernels import fused_experts as fe
    from dbo.kernels import triton_launch
    from dbo.moe import Workspace

    case = make_case(tokens, 7168, inter, local)
    est = tokens * case.ids.shape[1] / 256
    out = torch.empty_like(case.x)
    experts, ws = SwiGLUExperts(num_global_experts=256), Workspace()
    steps = fused_steps(case, inter, local, fe.prefer_persistent(est, tokens * case.ids.shape[1], local))
    steps.update({
        "fused_swiglu_experts": lambda: fe.fused_swiglu_experts(
            case.x, case.w1, case.w2, case.weights, case.ids, out=out, rows_per_expert=est),
        "SwiGLUExperts.apply": lambda: apply_experts(experts, case, False, ws),
    })
    print(f"I={inter} L={local} T={tokens}: host us per call (direct launcher / kernel[grid])")
    for name, fn in steps.items():
        got = []
        for fast in ("1", "0"):
            os.environ["DBO_TRITON_FAST_LAUNCH"] = fast
            triton_launch.clear_launch_cache()
            got.append(per_call_us(fn, n=50))
        print(f"  {name:<24} {got[0]:7.1f} / {got[1]:7.1f}", flush=True)
    os.environ.pop("DBO_TRITON_FAST_LAUNCH")
    triton_launch.clear_launch_cache()

if __name__ == "__main__":
    main()
