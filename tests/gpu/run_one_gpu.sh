#!/usr/bin/env bash
# What can be checked on ONE GPU, in one device call (under 10 minutes):
#   source .whl/prelude.sh && bash tests/gpu/run_one_gpu.sh OUTDIR
# the context's GPU tests, SM partitioning, the copy_engine backend with 2 ranks sharing the GPU
# (protocol and numbers; timings mean nothing there) and its stop test, the library experts
# (no host sync; at least as fast as the former benchmark experts), and the switch cost of the
# current tree against an older one in .before/ (if present: `git archive REV dbo backends
# examples/bench_switch.py | tar -x -C .before`), alternating.
# "bench": the overlap benchmark at one rank (all2all; the thin prefill shape) before (.before's
# examples/bench_overlap.py) and after (python -m dbo.bench overlap), alternating; "hf": the
# DeepSeek-V3 layer shape (4 layers) converted at one rank, plain vs DBO; "faults": a dead,
# stalled or slow peer inside deepep_ht/deepep_ll calls (tests/gpu/run_deepep_faults.py).
#   STEPS="core ce experts switch bench hf"   which steps (default: the first four)
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/one_gpu_log.txt"
steps=${STEPS:-"core ce experts switch"}
tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"  # run, has, status
if has core; then
  run core-gpu-tests 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_streams_gpu.py \
    tests/gpu/test_partition_gpu.py -rA -s
fi
if has ce; then
  run ce-conformance 200 torchrun --nproc-per-node 2 tests/gpu/run_copy_engine.py --json "$out/ce.json"
  run ce-self-sized 200 torchrun --nproc-per-node 2 tests/gpu/run_copy_engine.py --quick --self-sized
  run ce-stop 60 torchrun --nproc-per-node 2 tests/gpu/run_copy_engine.py --stop-test
fi
if has faults; then  # a dead/stalled/slow peer inside DeepEP calls, 2 ranks on the GPU (issue 18)
  run deepep-faults 400 python3 tests/gpu/run_deepep_faults.py --bench --json "$out/faults.json"
fi
if has experts; then
  run experts 240 bash tests/gpu/run_experts.sh "$out/experts"
fi
if has switch; then
  for i in 1 2 3; do
    if [ -d .before ]; then
      run "switch-before-$i" 60 env PYTHONPATH=".before:${PYTHONPATH:-}" python3 .before/examples/bench_switch.py --device cuda
    fi
    run "switch-now-$i" 60 python3 -m dbo.bench switch --device cuda
  done
fi
if has bench; then
  shape="--device cuda --backend all2all --tokens 4096 16384 --intermediate 256 --attn-width 1024 --layers 8
    --no-autotune --profile-shape none --time-budget-s 70"
  for i in 1 2; do
    if [ -d .before ]; then
      run "bench-before-$i" 120 env PYTHONPATH=".before:${PYTHONPATH:-}" torchrun --nproc-per-node 1 \
        .before/examples/bench_overlap.py $shape --expert-chunks 1 --out "$tmp/before$i"
    fi
    run "bench-now-$i" 120 torchrun --nproc-per-node 1 -m dbo.bench overlap $shape --out "$tmp/now$i"
  done
fi
if has hf; then
  run hf-deepseek-1gpu 240 torchrun --nproc-per-node 1 examples/hf_moe.py --device cuda --steps 3 \
    --warmup 1 --preset deepseek-v3 --layers 4 --backend naive --shape 8x2048 --json "$out/hf_deepseek_1gpu.json"
fi
echo "=== overall status $status" | tee -a "$log"
exit $status
