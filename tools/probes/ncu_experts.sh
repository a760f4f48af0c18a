#!/usr/bin/env bash
# Nsight Compute on the fused experts' kernels of one shape (the GPU host has ncu):
#   bash tools/probes/ncu_experts.sh OUTDIR [I L T] [kernel regex]
# Runs the library's apply three times (the first compiles) and profiles the last call's
# kernels matching the regex: speed of light, memory, warp stalls, occupancy (text report).
# SKIP (default 4) launches of matching kernels are skipped first: the regex's matches per apply
# times two (the first two applies), e.g. SKIP=2 COUNT=1 for a regex matching one kernel.
# FULL=1: every section (``--set full``, the warp stall reasons among them) into a report, then
# its details page and its SASS source page with per-instruction stall samples (CSV) as text.
set -uo pipefail
out=${1:-out}; inter=${2:-256}; local=${3:-256}; tokens=${4:-16384}; regex=${5:-"gate_up|down"}
mkdir -p "$out"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
tag="${inter}_${local}_${tokens}"
if [ -n "${FULL:-}" ]; then
  sections=(--set full --import-source yes -o "$out/rep_$tag" -f)
else
  sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
            --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats)
fi
"$ncu" --kernel-name "regex:$regex" --launch-skip "${SKIP:-4}" --launch-count "${COUNT:-2}" \
  "${sections[@]}" python3 - "$inter" "$local" "$tokens" > "$out/ncu_$tag.txt" 2>&1 <<'PY'
import sys
import torch
from dbo.bench.experts.command import experts_call, make_case
inter, local, tokens = (int(v) for v in sys.argv[1:4])
call = experts_call(make_case(tokens, 7168, inter, local))
for _ in range(3):
    call()
torch.cuda.synchronize()
print("done", inter, local, tokens)
PY
echo "ncu rc=$? -> $out/ncu_$tag.txt"
if [ -n "${FULL:-}" ]; then
  "$ncu" -i "$out/rep_$tag.ncu-rep" --page details --print-details all >> "$out/ncu_$tag.txt" 2>&1
  "$ncu" -i "$out/rep_$tag.ncu-rep" --page source --print-source sass --csv > "$out/sass_$tag.csv" 2>&1
  echo "details and SASS pages -> $out/ncu_$tag.txt, $out/sass_$tag.csv"
fi
