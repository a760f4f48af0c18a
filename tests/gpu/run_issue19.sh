#!/usr/bin/env bash
# Issue 19 on TWO GPUs (nvidia-h200-x2), in one device call of under 10 minutes. Once, here:
#   EXTRA_WHEELS="transformers==5.23.0" ../shared/gpu/fetch-wheels.sh   # the host has 5.17; EP needs 5.23
# then on the device (carry .whl):
#   source .whl/prelude.sh && bash tests/gpu/run_issue19.sh $OUT
# 1. the expert schedules on two GPUs: `dbo.bench overlap` at T 4096/16384 x I 256/2048, width
#    1024, 8 layers, deepep_ht and copy_engine: serial, split, merged (+ compute/comm with the
#    limit column and the autotune's chosen schedule), then the best DBO over the best serial of
#    any backend (compare step);
# 2. transformers' expert parallelism side by side: Qwen3-30B-A3B at full size (48 layers, random
#    weights from the config, written once to $HF_CKPT), 2 ranks, 8x2048 and 16x4096 per rank:
#    transformers' own all_to_all, dbo_all2all / dbo_copy_engine / dbo_deepep_ht plain and with
#    DBOPrefill (split and merged): tokens/s per GPU, peak GPU memory, logits against all_to_all.
#   STEPS="ht ce compare hf"   DEADLINE_S=570   HF_CKPT=/tmp/qwen3-30b-a3b
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
log="$out/issue19_log.txt"
steps=${STEPS:-"ht ce compare hf"}
deadline=$((SECONDS + ${DEADLINE_S:-570}))
ckpt=${HF_CKPT:-/tmp/qwen3-30b-a3b}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# The host's shared GPUs must never use NVLink multicast (KINDS.md of the device tool).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"  # run, has, status
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
python3 -c 'import torch, transformers; print("gpus", torch.cuda.device_count(), "transformers",
            transformers.__version__)' | tee -a "$log"
ov="--device cuda --tokens 4096 16384 --intermediate 256 2048 --attn-width 1024 --layers 8
    --profile-shape none --steps 10 --time-budget-s 110"
if has ht; then
  run overlap-deepep_ht 140 torchrun --nproc-per-node 2 -m dbo.bench overlap $ov --backend deepep_ht \
    --out "$out/ov_deepep_ht"
fi
if has ce; then
  run overlap-copy_engine 140 torchrun --nproc-per-node 2 -m dbo.bench overlap $ov --backend copy_engine \
    --out "$out/ov_copy_engine"
fi
if has compare; then
  run compare 30 python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
best = {}  # (tokens, I) -> {"serial": (ms, backend), "dbo": (ms, backend/schedule)}
for b in ("deepep_ht", "copy_engine"):
    f = out / f"ov_{b}" / "bench_overlap.json"
    if not f.exists():
        print(f"{b}: no bundle"); continue
    bundle = json.loads(f.read_text())
    for inter, tuned in (bundle.get("autotune") or {}).items():
        print(f"{b} I={inter}: autotune chose {tuned.get('schedule')}")
    for sh in bundle["shapes"]:
        s, key = sh.get("summary") or {}, (sh["tokens"], sh["intermediate"])
        cur = best.setdefault(key, {"serial": (float("inf"), "-"), "dbo": (float("inf"), "-")})
        if s.get("serial_ms"):
            cur["serial"] = min(cur["serial"], (s["serial_ms"], b))
        for sched, k in (("split", "dbo_ms"), ("merged", "merged_ms")):
            if s.get(k):
                cur["dbo"] = min(cur["dbo"], (s[k], f"{b}/{sched}"))
print("| T | I | best serial ms (backend) | best DBO ms (backend/schedule) | best DBO / best serial |")
print("|---|---|---|---|---|")
for (t, i), c in sorted(best.items()):
    (ts, bs), (td, bd) = c["serial"], c["dbo"]
    print(f"| {t} | {i} | {ts:.2f} ({bs}) | {td:.2f} ({bd}) | {ts / td:.3f}x |")
PY
fi
if has hf; then
  save=()
  [ -f "$ckpt/config.json" ] || save=(--save-checkpoint "$ckpt")
  run hf-qwen-ep 330 torchrun --nproc-per-node 2 examples/hf_moe.py --device cuda --preset qwen3-30b-a3b \
    "${save[@]}" --checkpoint "$ckpt" --hf-all-to-all --backend all2all copy_engine deepep_ht \
    --expert-schedule split merged --shape 8x2048 16x4096 --steps 3 --warmup 1 --json "$out/hf_ep.json"
fi
for d in "$out"/ov_*; do  # one file each comes back (the device tool returns at most 8)
  [ -d "$d" ] && tar -C "$out" -czf "$d.tgz" "$(basename "$d")" && rm -rf "$d"
done
echo "=== overall status $status" | tee -a "$log"
exit $status
