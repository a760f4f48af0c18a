#!/usr/bin/env bash
# Everything that needs the GPU host, in one call (device time is scarce).
# From the project root on a host with 2 GPUs, after `bash ../shared/gpu/fetch-wheels.sh`:
#   source .whl/prelude.sh && bash tests/gpu/run_all.sh [OUTDIR]
# Writes OUTDIR/gpu_log.txt (everything printed) and a few JSON files; exits non-zero if any
# step failed. Steps can be picked with STEPS="env core bench nccl demo deepep" (default: all).
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/gpu_log.txt"
steps=${STEPS:-"env core bench nccl demo deepep"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
status=0
run() {  # run NAME CMD...: log the command, its output and its exit code
  local name=$1; shift
  echo "=== [$name] \$ $*" | tee -a "$log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc (took $((SECONDS - t0)) s)" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}
has() { [[ " $steps " == *" $1 "* ]]; }

if has env; then
  run env bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m | head -5;
    python3 -c "import torch, greenlet; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(), \"nccl\", torch.cuda.nccl.version(), \"greenlet\", greenlet.__version__)"'
fi
if has core; then
  run core-gpu-tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_streams_gpu.py -rA
fi
if has bench; then
  run bench-switch-cuda python3 examples/bench_switch.py --device cuda --json "$out/bench_switch_cuda.json"
  run bench-switch-cpu python3 examples/bench_switch.py --device cpu --json "$out/bench_switch_cpu.json"
fi
if has nccl; then
  run nccl-backend-tests python3 -m pytest -q -p no:cacheprovider tests/test_backends_nccl.py -rA
fi
if has demo; then
  for b in naive all2all; do
    run "demo-$b" torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --backend "$b" \
      --trace "$out/demo_$b.trace.json"
  done
  for b in deepep_ht deepep_ll; do  # DeepEP combines bf16 only
    run "demo-$b" torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --backend "$b" \
      --dtype bfloat16 --hidden 2048 --tokens 256 --experts 16 --topk 4 --trace "$out/demo_$b.trace.json"
  done
fi
if has deepep; then
  run deepep-gpu-tests torchrun --nproc-per-node 2 tests/gpu/run_deepep.py --json "$out/deepep_results.json"
fi
echo "=== overall status $status" | tee -a "$log"
exit $status
