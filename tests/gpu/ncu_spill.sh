#!/usr/bin/env bash
# Nsight Compute on the warp-specialized gate/up kernel with and without the swapped spill tiles of
# commit 639c501 (reverted; perf_notes 5r), at I=2048, 256 local experts, T=4096 (128 +- 11 rows per
# expert, about half of the experts with a spill tile):
#   git show 639c501:dbo/moe/gluon_gate_up.py > .whl/spill_gg.py
#   bash tests/gpu/ncu_spill.sh OUTDIR
# Profiles the third and fourth launches (spill 0, then 32; the first two compile): duration,
# DRAM bytes, L2 and tensor pipe throughput, warp stalls (text report).
set -uo pipefail
out=${1:-out}
mkdir -p "$out"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --kernel-name "regex:gate_up_ws" --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum \
  python3 - > "$out/ncu_spill.txt" 2>&1 <<'PY'
import importlib.util
import torch
from dbo.bench.experts import make_case
from dbo.moe import fused_experts as fe
spec = importlib.util.spec_from_file_location("spill_gg", ".whl/spill_gg.py")
gg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gg)
t, local, inter = 4096, 256, 2048
case = make_case(t, 7168, inter, local, seed=t)
order, offsets = fe.route_order(case.ids, local)
tiles = fe.tile_map(offsets, 128, t * 8)[0]
act = torch.empty(t * 8, inter, dtype=case.x.dtype, device="cuda")
for spill in (0, 32, 0, 32):
    gg.launch_gate_up_ws(case.x, order, tiles, case.w1, act, 8, 132, block_m=128, stages=4, spill=spill)
torch.cuda.synchronize()
print("done")
PY
echo "ncu rc=$? -> $out/ncu_spill.txt"
