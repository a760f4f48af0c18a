#!/usr/bin/env bash
# Issue 16's measurements on ONE GPU (an H200), in three device calls of under 10 minutes each:
#   source .whl/prelude.sh && STEPS=grid bash tests/gpu/run_issue16.sh OUTDIR
#   source .whl/prelude.sh && STEPS="check overlap decode" bash tests/gpu/run_issue16.sh OUTDIR
#   source .whl/prelude.sh && STEPS="deepseek qwen" bash tests/gpu/run_issue16.sh OUTDIR
# check: the experts' and the schedules' GPU tests; grid: python -m dbo.bench experts over the
# issue's grid (fused/unfused, each timed twice: the GPU's time and an isolated call's latency;
# x limit; about three minutes; SMI=1: with the GPU's clock, power and temperature sampled, for
# tests/gpu/smi_rows.py); overlap: the one-rank overlap benchmark (naive, width
# 1024, 8 layers) at T 4096/16384 x I 256/2048, all three schedules and the autotune; decode: T
# 64/256/512 at I 2048, 4 layers; deepseek/qwen: examples/hf_moe.py at one rank, plain vs DBO
# split and merged (DeepSeek-V3 shape 4 layers; Qwen3-30B-A3B full size, 48 layers).
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/issue16_log.txt"
steps=${STEPS:-"check grid overlap decode"}
deadline=$((SECONDS + ${DEADLINE_S:-570}))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"  # run, has, status
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
ov="--device cuda --backend naive --attn-width 1024 --profile-shape none"
ex="examples/hf_moe.py --device cuda --steps 10 --warmup 2 --backend naive --expert-schedule split merged --find-syncs"
if has check; then
  tests="tests/gpu/test_experts_gpu.py"
  [ -f tests/gpu/test_schedules_gpu.py ] && tests="$tests tests/gpu/test_schedules_gpu.py"
  run check 330 python3 -m pytest -q -p no:cacheprovider $tests
fi
if has grid; then
  # SMI=1: nvidia-smi samples the GPU every 100 ms and each line of the grid gets its epoch time,
  # for tests/gpu/smi_rows.py (the clock, power and temperature of each row)
  if [ "${SMI:-0}" = 1 ]; then
    nvidia-smi --query-gpu=uuid,name,vbios_version,power.limit,clocks.max.sm,temperature.gpu --format=csv \
      | tee -a "$log"
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_event_reasons.active \
      --format=csv,noheader -lms 100 >"$out/smi_grid.csv" 2>&1 &
    smi=$!
    run grid 480 bash -c 'python3 -m dbo.bench experts --steps 20 --json "$1/experts.json" 2>&1 |
      while IFS= read -r l; do echo "$(date +%s.%N) $l"; done; exit "${PIPESTATUS[0]}"' _ "$out"
    kill "$smi"
  else
    run grid 480 python3 -m dbo.bench experts --steps 20 --json "$out/experts.json"
  fi
fi
if has overlap; then
  run overlap 240 torchrun --nproc-per-node 1 -m dbo.bench overlap $ov --layers 8 --tokens 4096 16384 \
    --intermediate 256 2048 --time-budget-s 200 --out "$out/overlap"
fi
if has decode; then
  run decode 150 torchrun --nproc-per-node 1 -m dbo.bench overlap $ov --layers 4 --tokens 64 256 512 \
    --intermediate 2048 --no-autotune --modes compute dbo_compute merged_compute serial dbo merged \
    --time-budget-s 120 --out "$out/decode"
fi
if has deepseek; then
  run deepseek 200 torchrun --nproc-per-node 1 $ex --preset deepseek-v3 --layers 4 --shape 8x2048 16x4096 \
    --json "$out/hf_deepseek.json"
fi
if has qwen; then
  run qwen 330 torchrun --nproc-per-node 1 $ex --preset qwen3-30b-a3b --shape 8x2048 --json "$out/hf_qwen.json"
fi
if has profile; then  # where the transformers DBO step loses time (merged schedule; kernel breakdown)
  for m in "qwen3-30b-a3b" "deepseek-v3 --layers 4"; do
    name=${m%% *}
    run "profile-$name" 200 torchrun --nproc-per-node 1 examples/hf_moe.py --device cuda --steps 3 --warmup 1 \
      --backend naive --expert-schedule merged --preset $m --shape 8x2048 --profile "$out/prof_$name"
    python3 -m dbo.bench breakdown "$out/prof_$name/naive/gpu_trace_serial.json" \
      "$out/prof_$name/naive/gpu_trace_dbo.json" 2>&1 | tee -a "$log"
    rm -rf "${out:?}/prof_$name"
  done
fi
for d in overlap decode; do  # one file each comes back (the device tool returns at most 8)
  [ -d "$out/$d" ] && tar -C "$out" -czf "$out/$d.tgz" "$d" && rm -rf "${out:?}/$d"
done
echo "=== overall status $status" | tee -a "$log"
exit $status
