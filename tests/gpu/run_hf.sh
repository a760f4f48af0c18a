#!/usr/bin/env bash
# transformers MoE models, expert parallel, plain vs DBO, at full size (random weights built from
# the config alone). From the project root on the GPU host, after `source .whl/prelude.sh`:
#   bash tests/gpu/run_hf.sh OUTDIR            # 2 GPUs: Qwen3-30B-A3B and DeepSeek-V3 layers
#   NGPU=1 bash tests/gpu/run_hf.sh OUTDIR     # 1 GPU: the full-size conversion builds and runs
# Writes OUTDIR/hf_log.txt (everything printed), OUTDIR/hf_*.json and torch.profiler traces of the
# largest shape (OUTDIR/prof_*/BACKEND/gpu_trace_{serial,dbo}.json, broken down by
# `python -m dbo.bench breakdown`), and prints all the tables together last; exits non-zero if
# any step failed.
#   STEPS="env smoke qwen deepseek qwen-small"   which steps (2 GPUs; default all, in this order)
#   DEADLINE_S=480                         the whole script's time; each step gets at most its
#                                          own cap and what is left, skipped under 20 s left
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/hf_log.txt"
ngpu=${NGPU:-2}
steps=${STEPS:-"env smoke qwen deepseek qwen-small"}
deadline=$((SECONDS + ${DEADLINE_S:-480}))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# The host's shared GPUs must never use NVLink multicast (KINDS.md of the device tool).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"  # run, has, status
ex="examples/hf_moe.py --device cuda --steps 3 --warmup 1"

if [ "$ngpu" = 1 ]; then
  # one rank holds all 128 experts (about 61 GB): proves the full-size conversion builds and runs
  run qwen-1gpu 300 torchrun --nproc-per-node 1 $ex --preset qwen3-30b-a3b --backend naive all2all \
    --shape 8x2048 --json "$out/hf_qwen_1gpu.json"
else
  if has env; then
    run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total --format=csv;
      python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__)"'
  fi
  if has smoke; then  # tiny DeepSeek-V3 config (shared experts, group routing, MLA): seconds
    run smoke 90 torchrun --nproc-per-node "$ngpu" $ex --preset tiny-deepseek_v3 --backend naive all2all deepep_ht \
      --shape 4x64 7x32 --unconverted --json "$out/hf_smoke.json"
  fi
  if has qwen; then  # about 32 GB per GPU converted; the unconverted model (61 GB) after it
    run qwen 240 torchrun --nproc-per-node "$ngpu" $ex --preset qwen3-30b-a3b --backend deepep_ht copy_engine all2all naive \
      --shape 8x2048 16x4096 --unconverted --profile "$out/prof_qwen" --json "$out/hf_qwen.json"
  fi
  if has deepseek; then  # 4 layers (1 dense + 3 MoE): about 40 GB per GPU converted
    run deepseek 240 torchrun --nproc-per-node "$ngpu" $ex --preset deepseek-v3 --layers 4 --backend deepep_ht copy_engine all2all \
      --shape 8x2048 16x4096 --unconverted --profile "$out/prof_deepseek" --json "$out/hf_deepseek.json"
  fi
  if has qwen-small; then  # decode-sized batches, where deepep_ll fits (<= 511 tokens per call)
    run qwen-small 150 torchrun --nproc-per-node "$ngpu" $ex --preset qwen3-30b-a3b --backend deepep_ll deepep_ht all2all \
      --shape 256x1 64x4 --max-tokens-per-rank 256 --json "$out/hf_qwen_small.json"
  fi
fi

for d in "$out"/prof_*/*/; do  # where each DBO step's time went (largest shape, rank 0)
  [ -f "$d/gpu_trace_dbo.json" ] || continue
  echo "=== breakdown ${d#$out/}" | tee -a "$log"
  python3 -m dbo.bench breakdown "$d/gpu_trace_serial.json" "$d/gpu_trace_dbo.json" 2>&1 | tee -a "$log"
done
echo "=== all tables (tokens/s per GPU; median of 3 steps, slowest rank)" | tee -a "$log"
python3 - "$out" <<'EOF' 2>&1 | tee -a "$log"
import glob, json, sys
print("| model | layers | GPUs | backend | batch x seq | plain ms | DBO ms | plain tok/s | DBO tok/s | speedup | rel err | top-1 agree |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(f"{sys.argv[1]}/hf_*.json")):
    d = json.load(open(path))
    for r in d["rows"]:
        if r["plain_ms"] is None:
            print(f"| {d['preset']} | {d['layers']} | {d['world']} | {r['backend']} | {r['split']} |||||||")
            continue
        t, plain, dbo = r["batch"] * r["seq"], r["plain_ms"], r["dbo_ms"]
        dbo_ms = "" if dbo is None else f"{dbo:.1f}"
        dbo_tps = "" if dbo is None else f"{t / dbo * 1e3:,.0f}"
        speed = "" if dbo is None else f"{plain / dbo:.2f}x"
        print(f"| {d['preset']} | {d['layers']} | {d['world']} | {r['backend']} | {r['batch']} x {r['seq']} "
              f"| {plain:.1f} | {dbo_ms} | {t / plain * 1e3:,.0f} | {dbo_tps} | {speed} "
              f"| {r['rel_err']:.1e} | {r['top1_agree']:.2f} |")
EOF
exit $status
