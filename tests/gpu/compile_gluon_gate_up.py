"""Compile the warp-specialized Gluon gate/up kernel (:mod:`dbo.moe.gluon_gate_up`) for sm_90 on a
machine without a GPU and report its registers per partition, spills and shared memory:

    python tests/gpu/compile_gluon_gate_up.py [BM:BN:STAGES:LOAD_WARPS:LOAD_REGS[:MAXNREG] ...] \
        [--ptx DIR]

The signature is what the runtime's specialization gives for real arguments (pointers and
16-divisible ints marked so), built here from CPU tensors. Triton 3.6 internals: a tool.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dbo.moe import gluon_gate_up as ws


def check(spec: str, ptx_dir: str | None = None, split: int = 1) -> dict:
    parts = [int(v) for v in spec.split(":")]
    bm, bn, stages, load_warps, load_regs = parts[:5]
    warps = bm // 16
    total = -(-(warps + load_warps) // 4) * 4
    maxnreg = parts[5] if len(parts) > 5 else (65536 // (32 * total)) // 8 * 8
    hidden, inter = 7168, 256
    w = torch.empty(8 * 2 * inter, hidden, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([bn, 64], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(w, [bn, 64], layout)
    x = torch.empty(64, hidden, dtype=torch.bfloat16)
    i32 = torch.empty(64, dtype=torch.int32)
    part = torch.empty(64, dtype=torch.float32)
    args = dict(x_ptr=x, order_ptr=i32, map_ptr=i32, w_desc=desc, act_ptr=x, part_ptr=part, count_ptr=i32,
                hidden=hidden, inter=inter)
    consts = dict(TOPK=8, BM=bm, STAGES=stages, LOAD_WARPS=load_warps, LOAD_REGS=load_regs,
                  SPLIT=split, num_warps=warps)
    sig, attrs = {}, {}
    names = list(args) + list(consts)
    for i, (k, v) in enumerate(args.items()):
        ty, spec_ = native_specialize_impl(BaseBackend, v, False, True, True)
        sig[k] = ty
        if spec_ == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for k in consts:
        sig[k] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    src = GluonASTSource(ws.gate_up_ws_kernel, sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=warps, num_stages=1, maxnreg=maxnreg))
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    ptx = Path(ptx_dir or "/tmp") / f"gate_up_ws_{spec.replace(':', '_')}.ptx"
    ptx.write_text(k.asm["ptx"])
    rep = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    setmax = sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])))
    return dict(spec=spec, maxnreg=maxnreg, regs=int(regs.group(1)) if regs else rep[-400:],
                spill=int(spill.group(1)) if spill else 0, setmaxnreg=setmax,
                smem_kb=round(k.metadata.shared / 1024, 1), ptx=str(ptx))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="*", default=["128:128:4:4:64"])
    p.add_argument("--ptx", default=None)
    p.add_argument("--split", type=int, default=1, help="the kernel's SPLIT (most shares of a split tile)")
    a = p.parse_args()
    for s in a.specs:
        print(check(s, a.ptx, a.split), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
