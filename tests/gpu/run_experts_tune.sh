#!/usr/bin/env bash
# Issue 16's expert measurements on ONE GPU, in one device call (under 10 minutes):
#   source .whl/prelude.sh && bash tests/gpu/run_experts_tune.sh OUTDIR
# STEPS: "check" the experts' GPU tests (no host sync, reference), "tune" the fused GEMMs' tile
# sweep, "flat" the down GEMM's flat/short-K candidates against the library's pick, "launch"
# the host's cost per launch and per step of the experts, "grid" python -m dbo.bench experts over the issue's grid (fused vs unfused, x limit).
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/experts_tune_log.txt"
steps=${STEPS:-"check tune grid"}
deadline=$((SECONDS + ${BUDGET_S:-560}))
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/lib.sh"  # run, has, status
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
if has check; then
  run experts-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_experts_gpu.py
fi
if has tune; then
  run tune 300 python3 tests/gpu/tune_experts.py --json "$out/tune.json" ${TUNE_ARGS:-}
fi
if has flat; then  # the down GEMM's candidates only: the library's pick, the short-K and flat tiles
  run flat-256 200 python3 tests/gpu/tune_experts.py --down-only --flat --intermediate 256 \
    --local-experts 32 128 256 --tokens 2048 8192 16384 65536 --json "$out/flat256.json"
  run flat-768-2048 200 python3 tests/gpu/tune_experts.py --down-only --flat --intermediate 768 2048 \
    --local-experts 32 256 --tokens 4096 16384 65536 --json "$out/flat_big.json"
fi
if has launch; then  # the host's cost per launch, and per step of the experts at small shapes
  run launch-cost 60 python3 tests/gpu/probe_launch_cost.py
  run host 120 python3 tests/gpu/probe_experts_host.py --json "$out/host.json"
fi
if has grid; then
  run grid 300 python3 -m dbo.bench experts --steps 20 --json "$out/experts.json" ${GRID_ARGS:-}
fi
echo "=== overall status $status" | tee -a "$log"
exit $status
