"""Shared memory, registers and spills of a fused-experts kernel's tile, compiled for sm_90 on a
machine without a GPU (Triton's compiler and its ``ptxas``): which tiles fit two programs per SM.

    python tools/probes/compile_check.py down_flat 128:256:64:8:3 64:256:64:4:2 ...

Each tile is ``BLOCK_M:BLOCK_N:BLOCK_K:num_warps:num_stages``. The signature marks pointers and
the 16-divisible ints with ``tt.divisibility=16`` as the runtime's specialization does (without
it every kernel shows spills the real one does not have). Triton 3.6 internals: a tool.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dbo.experts.kernels import fused_experts as fe
from dbo.experts.kernels import fused_kernels as fk


def _flat(bm, bn, bk, sole=False):
    sig = {"act_desc": f"tensordesc<bf16[{bm}, {bk}]>", "order_ptr": "*i32", "map_ptr": "*i32",
           "w_desc": f"tensordesc<bf16[{bn}, {bk}]>", "y_ptr": "*bf16", "tw_ptr": "*fp32", "out_ptr": "*bf16",
           "hidden": "i32", "inter": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "TOPK": "constexpr", "SOLE": "constexpr"}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "TOPK": 8, "SOLE": sole}
    return fk.down_flat_kernel, sig, consts, ("order_ptr", "map_ptr", "y_ptr", "tw_ptr", "out_ptr", "hidden",
                                              "inter")


def _flat_sole(bm, bn, bk):
    return _flat(bm, bn, bk, sole=True)


def _gate_up(bm, bn, bk):
    sig = {"x_ptr": "*bf16", "order_ptr": "*i32", "offs_ptr": "*i32", "w": f"tensordesc<bf16[{bn}, {bk}]>",
           "act_ptr": "*bf16", "n_experts": "i32", "hidden": "i32", "inter": "i32", "stride_we": "i32",
           "TOPK": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "BLOCK_E": "constexpr", "GROUP_M": "constexpr", "TAIL_M": "constexpr", "EVEN_K": "constexpr",
           "PRECISION": "constexpr", "TMA": "constexpr", "PERSISTENT": "constexpr"}
    consts = {"TOPK": 8, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_E": 256, "GROUP_M": 8,
              "TAIL_M": 0, "EVEN_K": True, "PRECISION": "tf32", "TMA": True, "PERSISTENT": False}
    return fk.gate_up_kernel, sig, consts, ("x_ptr", "order_ptr", "offs_ptr", "act_ptr", "hidden", "inter",
                                            "stride_we")


KERNELS = {"down_flat": _flat, "down_flat_sole": _flat_sole, "gate_up": _gate_up}


def check(name: str, tile: str) -> dict:
    bm, bn, bk, warps, stages = (int(v) for v in tile.split(":"))
    fn, sig, consts, div16 = KERNELS[name](bm, bn, bk)
    if "STAGES" in consts:
        consts["STAGES"] = stages
    names = list(sig)
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div16})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=warps, num_stages=stages))
    Path("/tmp/_compile_check.ttgir").write_text(k.asm["ttgir"])
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    ptx = Path("/tmp/_compile_check.ptx")
    ptx.write_text(k.asm["ptx"])
    rep = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", rep).group(1))
    spill = re.search(r"(\d+) bytes spill stores", rep)
    smem = k.metadata.shared
    # as the library sizes its persistent grids, on an H100/H200 SM (228 KB, 64K registers)
    per_sm = fe._per_sm(SimpleNamespace(metadata=k.metadata, n_regs=regs),
                        SimpleNamespace(shared_memory_per_multiprocessor=228 * 1024,
                                        regs_per_multiprocessor=65536))
    return dict(tile=tile, regs=regs, spill=int(spill.group(1)) if spill else 0,
                smem_kb=round(smem / 1024, 1), per_sm=per_sm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=sorted(KERNELS))
    p.add_argument("tiles", nargs="+")
    a = p.parse_args()
    for t in a.tiles:
        print(check(a.kernel, t), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
