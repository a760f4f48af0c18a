#!/usr/bin/env bash
# Everything that needs the GPU host, in one call (device time is scarce).
# From the project root on a host with 2 GPUs, after `bash ../shared/gpu/fetch-wheels.sh`:
#   source .whl/prelude.sh && bash tests/gpu/run_all.sh [OUTDIR]
# Writes OUTDIR/gpu_log.txt (everything printed) and OUTDIR/gpu_bundle.tgz (JSON results and
# traces of every step); exits non-zero if any step failed.
#   STEPS="env core bench experts demo deepep nccl overlap thin thin4 ce ce_ht"   which steps (default:
#                                                      all but experts, thin4 and big4, in this
#                                                      order; thin4/big4 need 4 GPUs; experts,
#                                                      ~3 min on one GPU, is also
#                                                      tests/gpu/run_experts.sh; ce and ce_ht,
#                                                      the copy-engine backend against deepep_ht
#                                                      and its green-context partition, are
#                                                      one call each, NPROC ranks (default 2);
#                                                      epn_conformance, epn_overlap, epn_hf:
#                                                      the same on every GPU of a 4/8-GPU host)
#   DEADLINE_S=420                                     the whole script's time; each step gets
#                                                      at most its own cap and what is left,
#                                                      and is skipped under 20 s left
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out/files"
log="$out/gpu_log.txt"
files="$out/files"
steps=${STEPS:-"env core bench demo deepep nccl overlap thin"}
deadline=$((SECONDS + ${DEADLINE_S:-420}))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# The host's shared GPUs must never use NVLink multicast (KINDS.md of the device tool).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"  # run, has, status

if has env; then
  run env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m | head -5;
    python3 -c "import torch, greenlet; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(), \"nccl\", torch.cuda.nccl.version(), \"greenlet\", greenlet.__version__)"'
fi
if has core; then
  run core-gpu-tests 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_streams_gpu.py -rA
fi
if has bench; then
  run bench-switch-cuda 60 python3 -m dbo.bench switch --device cuda --json "$files/bench_switch_cuda.json"
  run bench-switch-cpu 60 python3 -m dbo.bench switch --device cpu --json "$files/bench_switch_cpu.json"
fi
if has experts; then  # the library experts: no host sync, vs the former benchmark experts
  run experts-gpu-tests 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_experts_gpu.py -rA
  run experts-timing 120 python3 tests/gpu/compare_experts.py --json "$files/experts_timing.json"
fi
if has demo; then
  for b in naive all2all; do
    run "demo-$b" 90 torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --backend "$b" \
      --trace "$files/demo_$b.trace.json"
  done
fi
if has deepep; then
  run deepep-gpu-tests 180 torchrun --nproc-per-node 2 tests/gpu/run_deepep.py --json "$files/deepep_results.json"
  for b in deepep_ht deepep_ll; do  # DeepEP combines bf16 only
    run "demo-$b" 90 torchrun --nproc-per-node 2 examples/moe_overlap.py --device cuda --backend "$b" \
      --dtype bfloat16 --hidden 2048 --tokens 256 --experts 16 --topk 4 --trace "$files/demo_$b.trace.json"
  done
fi
if has nccl; then
  run nccl-backend-tests 180 python3 -m pytest -q -p no:cacheprovider tests/test_backends_nccl.py -rA
fi
if has overlap; then
  # The overlap benchmark on a reduced grid that fits one device call (the full grids:
  # docs/perf_notes.md), each followed by dbo.autotune and the wrapper with the tuned config.
  run bench-kernels-gpu 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bench_kernels_gpu.py -rA
  run overlap-deepep_ll 140 torchrun --nproc-per-node 2 -m dbo.bench overlap --device cuda \
    --backend deepep_ll --tokens 32 64 128 256 512 --cuda-graph \
    --time-budget-s 110 --out "$files/overlap_ll"
  run overlap-deepep_ht 160 torchrun --nproc-per-node 2 -m dbo.bench overlap --device cuda \
    --backend deepep_ht --layers 8 --tokens 1024 4096 16384 --intermediate 512 \
    --num-sms 24 48 --dbo-sm-carveout none 24 --time-budget-s 130 --out "$files/overlap_ht"
fi
thin() {  # thin NAME NPROC EXTRA...: deepep_ht where communication is a larger share of a layer
  local name=$1 nproc=$2; shift 2
  run "$name" 170 torchrun --nproc-per-node "$nproc" -m dbo.bench overlap --device cuda \
    --backend deepep_ht --layers 8 --intermediate 256 --attn-width 1024 \
    --num-sms 24 48 --time-budget-s 140 --out "$files/$name" "$@"
}
if has thin; then
  # thin experts (I=256) and a thin attention stand-in (width 1024); SM carve-outs for DBO;
  # then the same with a yield inside the attention stand-in
  thin overlap_thin 2 --tokens 4096 8192 16384 --dbo-sm-carveout none 24 48
  thin overlap_thin_yield 2 --tokens 4096 16384 --attn-yield --dbo-sm-carveout none 24
fi
if has thin4; then  # on 4 GPUs (more of each rank's traffic leaves the GPU)
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    thin overlap_thin4 4 --tokens 8192 16384 --dbo-sm-carveout none 24
    # the full attention stand-in (width 4096): enough compute on both sides of the combine
    thin overlap_balanced4 4 --tokens 16384 --attn-width 4096 --intermediate 256 512 \
      --dbo-sm-carveout none 24
  else
    echo "=== [thin4] SKIPPED: fewer than 4 GPUs" | tee -a "$log"
  fi
fi
if has big4; then  # the best 4-GPU shape at 32k tokens and 12 layers a step (less fill/drain)
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    thin overlap_big4 4 --tokens 16384 32768 --layers 12 --num-sms 48 --no-autotune
  else
    echo "=== [big4] SKIPPED: fewer than 4 GPUs" | tee -a "$log"
  fi
fi
# The zero-SM copy-engine backend against deepep_ht on the thin prefill shapes (issue 13):
# "ce" = its GPU conformance, the stop test and its overlap grid; "ce_ht" = deepep_ht on the same
# grid, plain and with DBO's compute on a green context (--dbo-compute-sms). Same shapes, so the
# two bundles compare row by row; the host's clocks drift by a few percent between calls.
ce_grid="--device cuda --layers 8 --intermediate 256 --attn-width 1024 --tokens 4096 8192 16384"
if has ce; then
  run ce-conformance 150 torchrun --nproc-per-node "${NPROC:-2}" tests/gpu/run_copy_engine.py \
    --json "$files/ce_conformance.json"
  run ce-stop 60 torchrun --nproc-per-node "${NPROC:-2}" tests/gpu/run_copy_engine.py --stop-test
  run overlap_ce 200 torchrun --nproc-per-node "${NPROC:-2}" -m dbo.bench overlap $ce_grid \
    --backend copy_engine --time-budget-s 170 --out "$files/overlap_ce"
fi
if has ce_ht; then
  run overlap_ce_ref_ht 170 torchrun --nproc-per-node "${NPROC:-2}" -m dbo.bench overlap $ce_grid \
    --backend deepep_ht --num-sms 24 48 --time-budget-s 140 --out "$files/overlap_ce_ref_ht"
  for n in 100 116; do  # DeepEP's 24-48 SMs against the compute's green context
    run "overlap_ht_green$n" 170 torchrun --nproc-per-node "${NPROC:-2}" -m dbo.bench overlap $ce_grid \
      --backend deepep_ht --num-sms 24 48 --dbo-compute-sms "$n" --time-budget-s 140 \
      --out "$files/overlap_ht_green$n"
  done
fi
# Issue 12, on every GPU of a 4- or 8-GPU host (NPROC to use fewer): the DeepEP conformance at
# that world size, the overlap grid (deepep_ht, copy_engine, deepep_ll; autotuned wrapper) and
# the transformers shapes, plain vs DBO. One step each, so that each fits one device call.
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
n_all=${NPROC:-$ngpu}
if has epn_conformance; then
  run "deepep-conformance-$n_all" 240 torchrun --nproc-per-node "$n_all" tests/gpu/run_deepep.py \
    --json "$files/deepep_results_$n_all.json"
  run "ce-conformance-$n_all" 150 torchrun --nproc-per-node "$n_all" tests/gpu/run_copy_engine.py \
    --json "$files/ce_conformance_$n_all.json"
fi
if has epn_overlap; then
  for b in deepep_ht copy_engine; do
    run "overlap-$b-$n_all" 200 torchrun --nproc-per-node "$n_all" -m dbo.bench overlap $ce_grid \
      --backend "$b" --time-budget-s 170 --out "$files/overlap_${b}_$n_all"
  done
  run "overlap-deepep_ll-$n_all" 150 torchrun --nproc-per-node "$n_all" -m dbo.bench overlap --device cuda \
    --backend deepep_ll --tokens 32 128 512 --time-budget-s 120 --out "$files/overlap_ll_$n_all"
fi
if has epn_hf; then
  NGPU=$n_all DEADLINE_S=500 bash tests/gpu/run_hf.sh "$files/hf_$n_all"
fi
echo "=== overall status $status" | tee -a "$log"
tar -czf "$out/gpu_bundle.tgz" -C "$files" . && rm -rf "$files"
exit $status
