#!/usr/bin/env bash
# The library experts on ONE GPU, in under 4 minutes: the sync-free/correctness tests, then the
# timing comparison against the overlap benchmark's former experts at the benchmark's shapes.
# From the project root:  bash tests/gpu/run_experts.sh [OUTDIR]
# Writes OUTDIR/experts_log.txt (everything printed) and OUTDIR/experts_timing.json; exits
# non-zero if a test failed or the library experts were slower than the old ones.
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/experts_log.txt"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source "$(dirname "$0")/lib.sh"  # run, has, status
run env 20 python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'cc', torch.cuda.get_device_capability()); import importlib.util as u; print('triton', u.find_spec('triton') is not None)"
# sync debug mode 'error' around apply(): any host sync raises; outputs vs the float64 reference
run experts-gpu-tests 100 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_experts_gpu.py \
  tests/gpu/test_bench_kernels_gpu.py
# library vs the former benchmark experts: hidden 7168/2048 x I 256/512/2048 x 128/64 local
# experts x 4096/8192/16384 received tokens, top-8; a table with speedups and a PASS/FAIL line
run experts-timing 120 python3 tests/gpu/compare_experts.py --json "$out/experts_timing.json"
echo "=== overall status $status (0: tests passed and the library experts are at least as fast)" | tee -a "$log"
exit $status
