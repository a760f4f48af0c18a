#!/usr/bin/env bash
# The GPU tests and measurements, by what each checks or measures. From the project root on a
# host with NVIDIA GPUs, after `pip install -e ".[deepep,hf]"` (README.md, "On GPUs"):
#
#   bash tests/gpu/run.sh [-o OUTDIR] [-d DEADLINE_S] STEP[:N] ...
#
# N is the number of ranks for the steps that take one (default 2). With fewer GPUs than ranks,
# the ranks share GPU 0 where the step allows it (copy_engine, deepep, faults): correctness only,
# the timings mean nothing. Steps run in the order given; each has a time cap, cut to what is left of
# DEADLINE_S (default 570 s; a step with under 20 s left is skipped and counts as failed).
#
#   env            the GPUs, the link topology, the versions of torch, NCCL, greenlet, transformers
#   core           the context on a GPU: stream/event protocol, SM partitioning, expert schedules,
#                  the simulated link; the test processes forked from the preloaded server on CUDA
#   experts        the experts' kernels: no host sync, against float32/float64 references
#   grid           `python -m dbo.bench experts` over the limit grid (one GPU, ~3 min); SMI=1
#                  samples clock/power/temperature (read back: tools/probes/smi_rows.py)
#   decodegrid     `python -m dbo.bench experts --layout batched`: the experts on low-latency slabs
#                  over the decode grid (8/32/128 local experts, T=64/256/512 per rank of 2, I=2048)
#                  against the limit (one GPU, ~2 min); DECODEGRID_ARGS (more options)
#   switch         `python -m dbo.bench switch` on CUDA and CPU (the cost of one ubatch switch)
#   copy_engine:N  the copy-engine backend's conformance (DBO == serial == reference), stop test
#   deepep:N       the DeepEP backends' conformance (high-throughput and low-latency)
#   faults:N       a dead, stalled or slow last rank inside DeepEP calls: every survivor's error and delay
#                  (FAULTS_ARGS: more options, e.g. "--backends ht --only gpu_stall")
#   nccl           the all2all/naive backends over NCCL (tests/test_backends_nccl.py)
#   hfoom:N        one rank short of device memory in DBOPrefill (tests/gpu/run_hf_oom.py; Qwen3-30B-A3B at
#                  full size as in hf, HFOOM_ARGS): the group falls back to plain where plain fits (the
#                  logits equal, the next smaller call overlaps again); named errors where nothing fits
#   hfbad          bad checkpoints and configs on the transformers path, 2 NCCL ranks on 2 GPUs
#                  (tests/test_hf_bad_inputs.py with DBO_TEST_DIST_BACKEND=nccl): one named error on every rank
#   hfgraph        greedy_generate(cuda_graph=True) on 2 NCCL ranks on 2 GPUs, copy_engine (float32) and deepep
#                  (bf16) (tests/test_hf_graph_decode.py with DBO_TEST_DIST_BACKEND=nccl): the captured and
#                  replayed decode steps give the eager plain decode's tokens (deepep: a plain forward's)
#   demo:N         examples/moe_overlap.py with each backend (DeepEP's when importable)
#   overlap:N      `dbo.bench overlap` on the thin prefill grid (8 layers, I=256, attention width
#                  1024, T=4096/8192/16384; I=2048 too with WIDE=1) for deepep_ht and copy_engine,
#                  then `dbo.bench compare`: best DBO over the best serial of any backend.
#                  BACKENDS="deepep_ht copy_engine copy_engine+put_order=rank" (NAME+KEY=VALUE: a
#                  --backend-opt), TOKENS, OVERLAP_ARGS (more options), OVERLAP_BUDGET_S, OVERLAP_CAP_S
#   decode:N       `dbo.bench overlap` at decode sizes (T=32..512, I=2048, CUDA graphs; every schedule, sbo and sbo_dbo
#                  too) on each of DECODE_BACKENDS (default deepep_ll; copy_engine too); DECODE_ARGS
#                  (more options, e.g. "--experts 32 --link 50,5 --remote-fraction 0.875"), TOKENS
#   link:N         the tables under the simulated link (remote 7/8) for each of LINKS ("50,5 25,10":
#                  GBPS,LATENCY_US): prefill with deepep_ht (24 SMs) and copy_engine at LINK_INTER
#                  ("256 2048") x TOKENS, compare, then decode with deepep_ll and 8 local experts
#                  per rank (DECODE_TOKENS, CUDA graphs); LINK_ARGS adds options to the prefill runs
#                  (e.g. "--dbo-sm-carveout none 8 16"); ~9 min for one link at 4 ranks
#   emulated       one GPU as one rank of a large deployment (the emulated backend, dbo.backends.emulated):
#                  its GPU tests (tests/gpu/test_emulated_gpu.py: the NIC-like link against its model, the
#                  rank against the remapped reference, graph replay), the low-latency calls alone against
#                  DeepEP's published table (tools/probes/emulated_comm.py), then decode at each of
#                  EMU_EPS ("16 32 64 128 256") with deepep_ll's layout (DeepSeek-V3's layer: 256 experts
#                  top-8, I=2048, one shared expert, 8 layers, CUDA graphs, every mode, the overlapped
#                  steps leaving EMU_DECODE_CARVEOUT (16) SMs to the link) under EMU_LINK
#                  (deepep-ib) at EMU_TOKENS ("32 64 128 256 512"); EMU_ARGS (more options); EMU_PREFILL=1
#                  adds prefill with deepep_ht's layout at EP EMU_PREFILL_EPS ("16 32 64"), T 4096 8192
#                  16384 x I 256 2048, eager, the DBO runs with each of EMU_PREFILL_CARVEOUTS ("none 8")
#                  SMs carved out; EMU_VALIDATE=1 adds the emulated rank of the 2- and 4-GPU
#                  link-model decode tables (EP 2 / 16 experts and EP 4 / 32 experts, remote 7/8, the
#                  link in host order, at each of EMU_VALIDATE_LINKS "25,10 50,5"), to hold against them;
#                  EMU_VALIDATE_EPS ("2 4"); EMU_TESTS=0 leaves out the tests and the probe; EMU_EPS=" "
#                  the decode grid
#   hostsplit      where the host's time of an eager prefill step goes (tools/probes/host_split.py): the
#                  emulated rank of EP HS_EP (32), deepep_ht, I=2048, 8 layers, at HS_TOKENS ("512 4096"):
#                  wall, waits on the GPU and own time per layer, the implicit host syncs, cProfile by own
#                  and by cumulative time (the .prof files in hostsplit.tgz); HS_TREE=DIR times another
#                  revision's tree the same way (DIR/dbo with its backends in dbo/backends: see the probe)
#   emulated_hf    a real transformers model as one rank of a large deployment, on one GPU (random weights,
#                  the rank's experts only; `dbo.bench hf-prefill|hf-generate --emulate-ep`): for each of
#                  EMU_HF_RUNS ("qwen-prefill qwen-generate dsv3-generate"): Qwen3-30B-A3B (48 layers) as
#                  rank 0 of EP 16, hf-prefill at 8x2048 16x4096 (split, merged) under EMU_HF_PREFILL_LINK
#                  (deepep-ib-ht); the same model's hf-generate of EMU_HF_BATCH ("64 256") sequences x
#                  (512 + 64) tokens under EMU_HF_LINK (deepep-ib), 3 alternating calls a row, graph decode
#                  rows too; DeepSeek-V3 (EMU_DSV3_LAYERS: 8) as rank 0 of EP 64, 256 sequences x
#                  (128 + 32); EMU_HF_CAP_S (540) per run: give run.sh -d for more than one;
#                  EMU_HF_PREFILL_ARGS ("--sm-carveout 8"), EMU_HF_ARGS ("--sm-carveout 8"): options
#                  for hf-prefill and for hf-generate
#   onerank        the one-rank overlap benchmark (naive: nothing to hide) at T 4096/16384 x
#                  I 256/2048, and the decode sizes: what splitting alone costs
#   hf:N           `dbo.bench hf-prefill`: a tiny DeepSeek-V3 smoke test, then Qwen3-30B-A3B at full size
#                  (random weights written by every rank, HF_LAYERS=48) loaded expert-parallel:
#                  transformers' all_to_all beside HF_BACKENDS, plain vs DBOPrefill at HF_SCHEDULES
#                  ("auto": the autotune's choice at each of HF_SHAPES; "split merged"), EP_EXPERTS
#                  ("library model" for both), HF_ARGS (more options); needs transformers >= 5.23
#                  (the hf extra)
#   generate:N     `dbo.bench hf-generate`: greedy decoding of 64 new tokens after 512-token prompts,
#                  batch 64 per rank: transformers' generate() (all_to_all) beside dbo's
#                  greedy_generate on GEN_BACKENDS (NAME or PREFILL/DECODE; default "copy_engine
#                  deepep_ht/deepep_ll"), plain and DBO, and the ids' agreement (GEN_STEPS timed
#                  calls each, default 1; GEN_MODES: the dbo rows, default "plain graph dbo-prefill-graph":
#                  the last two decode from a CUDA graph, greedy_generate(cuda_graph=True); "dbo-prefill"
#                  and "dbo" (every decode step overlapped) are eager), each row's teacher-forced share
#   hffaults:N     a rank that exits or stalls (host or GPU) before the dispatch, between dispatch and
#                  combine or after the combine, inside DBOPrefill and a greedy_generate decode step, on
#                  dbo_copy_engine, dbo_deepep (where deep_ep imports) and transformers' all_to_all (the
#                  comparison): each survivor's error and its delay, every process's exit
#                  (tests/gpu/run_hf_faults.py, N GPUs; dbo's cases 4 at a time, then transformers' 18 at a
#                  time; HFF_TIMEOUT: dbo's timeout, default 3 s; no case starts after HFF_BUDGET_S, default
#                  450; HFF_CAP_S, default 540; HFF_ARGS, e.g. "--parallel 2")
#   soak:N         a soak of the transformers path (tests/gpu/run_hf_soak.py): Qwen3-30B-A3B at full
#                  size (HF_CKPT, HF_LAYERS as in hf) loaded with dbo_copy_engine, DBO against plain once,
#                  then DBOPrefill and greedy_generate calls of random batch (1 2 4 8) and prompt length
#                  (64-4096) for SOAK_S s (default: the cap, SOAK_CAP_S 540, less 140 s to write, load and
#                  end): memory after each call flat within 1% after the warm-up, no error, tokens/s first
#                  and last; SOAK_ARGS (more options, e.g. "--backend all2all --new-tokens 32"); the hf extra
#
# TORCHRUN_ARGS goes to every torchrun (e.g. "--master-port 29600" for a second run.sh beside
# the first, each on its own CUDA_VISIBLE_DEVICES). Writes OUTDIR/run_log.txt (everything
# printed; default OUTDIR: $OUT, else ./out) and one OUTDIR/STEP.tgz per step that writes files
# (JSON bundles, traces). Exits non-zero if a step failed. NVLink multicast stays off (NCCL's
# NVLS, symmetric memory's and NVSHMEM's), as in every figure of docs/.
set -uo pipefail
out=${OUT:-out}
deadline_s=570
while getopts "o:d:h" opt; do
  case $opt in
    o) out=$OPTARG ;;
    d) deadline_s=$OPTARG ;;
    *) sed -n '2,/^set /{/^#/p}' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { sed -n '2,/^set /{/^#/p}' "$0"; exit 2; }
mkdir -p "$out"
log="$out/run_log.txt"
deadline=$((SECONDS + deadline_s))
status=0
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
pytest_gpu="python3 -m pytest -q -p no:cacheprovider -rA"

run() {  # run NAME CAP_S CMD...: log the command, its output and its exit code
  local name=$1 cap=$2; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== [$name] SKIPPED: ${left}s left of the deadline" | tee -a "$log"
    status=1
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== [$name] (cap ${cap}s) \$ $*" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc (took $((SECONDS - t0)) s)" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

bundle() {  # bundle STEP: one archive per step's files (fewer files to bring back)
  local dir="$out/$1"
  if [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    tar -C "$out" -czf "$out/$1.tgz" "$1" && rm -rf "${dir:?}"
  fi
}

tr_="torchrun ${TORCHRUN_ARGS:-} --nproc-per-node"  # then N ARGS...

ov_thin="--device cuda --layers 8 --attn-width 1024 --profile-shape none"
#: every mode of the overlap benchmark, sbo included (the decode steps)
all_modes="compute dbo_compute merged_compute comm serial dbo merged sbo sbo_dbo"

for arg in "$@"; do
  step=${arg%%:*}
  n=2
  [ "$arg" != "$step" ] && n=${arg#*:}
  files="$out/$step"
  mkdir -p "$files"
  case $step in
    env)
      run env 60 bash -c 'nvidia-smi --query-gpu=uuid,name,memory.total,driver_version,power.limit --format=csv;
        nvidia-smi topo -m | head -12;
        python3 -c "import torch, greenlet; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
          \"gpus\", torch.cuda.device_count(), \"nccl\", torch.cuda.nccl.version(), \"greenlet\", greenlet.__version__)";
        python3 -c "import transformers; print(\"transformers\", transformers.__version__)" || true;
        python3 -c "import deep_ep; print(\"deep_ep\", deep_ep.__file__)" || true' ;;
    core)
      run core 240 $pytest_gpu tests/gpu/test_streams_gpu.py tests/gpu/test_partition_gpu.py tests/gpu/test_memory_gpu.py tests/gpu/test_link_gpu.py \
        tests/gpu/test_schedules_gpu.py tests/gpu/test_launch_gpu.py ;;
    experts)
      run experts 330 $pytest_gpu tests/gpu/test_experts_gpu.py tests/gpu/test_bench_kernels_gpu.py \
        tests/gpu/test_segments_gpu.py ;;
    grid)
      if [ "${SMI:-0}" = 1 ]; then
        nvidia-smi --query-gpu=uuid,name,vbios_version,power.limit,clocks.max.sm,temperature.gpu --format=csv \
          | tee -a "$log"
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_event_reasons.active \
          --format=csv,noheader -lms 100 >"$files/smi_grid.csv" 2>&1 &
        smi=$!
        # each line behind its epoch time, for tools/probes/smi_rows.py
        run grid 480 bash -c 'python3 -m dbo.bench experts --steps 20 --json "$1/experts.json" 2>&1 |
          while IFS= read -r l; do echo "$(date +%s.%N) $l"; done | tee "$1/grid_log.txt"; exit "${PIPESTATUS[0]}"' _ "$files"
        kill "$smi"
      else
        run grid 480 python3 -m dbo.bench experts --steps 20 --json "$files/experts.json"
      fi ;;
    decodegrid)
      run decodegrid 300 python3 -m dbo.bench experts --layout batched --steps 20 ${DECODEGRID_ARGS:-} \
        --json "$files/experts_batched.json" ;;
    switch)
      run switch-cuda 60 python3 -m dbo.bench switch --device cuda --json "$files/switch_cuda.json"
      run switch-cpu 60 python3 -m dbo.bench switch --device cpu --json "$files/switch_cpu.json" ;;
    copy_engine)
      run "copy_engine-$n" 240 $tr_ "$n" tests/gpu/run_copy_engine.py --json "$files/conformance_$n.json"
      run "copy_engine-stop-$n" 90 $tr_ "$n" tests/gpu/run_copy_engine.py --stop-test ;;
    deepep)
      shared=()
      [ "$ngpu" -lt "$n" ] && shared=(--shared-gpu)
      run "deepep-$n" 300 $tr_ "$n" tests/gpu/run_deepep.py "${shared[@]}" --json "$files/conformance_$n.json" ;;
    faults)
      run "faults-$n" 400 python3 tests/gpu/run_deepep_faults.py --nproc "$n" --bench ${FAULTS_ARGS:-} --json "$files/faults_$n.json" ;;
    hffaults)
      run "hffaults-$n" "${HFF_CAP_S:-540}" python3 tests/gpu/run_hf_faults.py --device cuda --nproc "$n" \
        --timeout "${HFF_TIMEOUT:-3}" --time-budget-s "${HFF_BUDGET_S:-450}" ${HFF_ARGS:-} \
        --json "$files/hf_faults.json" ;;
    hfoom)
      run "hfoom-$n" "${HFOOM_CAP_S:-300}" $tr_ "$n" tests/gpu/run_hf_oom.py --device cuda ${HFOOM_ARGS:-} \
        --json "$files/hf_oom.json" ;;
    hfbad)
      run hfbad 300 env DBO_TEST_DIST_BACKEND=nccl python3 -m pytest -q -p no:cacheprovider tests/test_hf_bad_inputs.py -rA ;;
    hfgraph)
      run hfgraph 300 env DBO_TEST_DIST_BACKEND=nccl python3 -m pytest -q -p no:cacheprovider \
        tests/test_hf_graph_decode.py -k two_ranks -rA ;;
    nccl)
      run nccl 180 python3 -m pytest -q -p no:cacheprovider tests/test_backends_nccl.py -rA ;;
    demo)
      for b in naive all2all copy_engine; do
        run "demo-$b-$n" 90 $tr_ "$n" examples/moe_overlap.py --device cuda --backend "$b" \
          --trace "$files/demo_$b.trace.json"
      done
      if python3 -c "import deep_ep" 2>/dev/null; then
        for b in deepep_ht deepep_ll; do  # DeepEP combines bf16 only
          run "demo-$b-$n" 90 $tr_ "$n" examples/moe_overlap.py --device cuda --backend "$b" --dtype bfloat16 \
            --hidden 2048 --tokens 256 --experts 16 --topk 4 --trace "$files/demo_$b.trace.json"
        done
      fi ;;
    overlap)
      inter="256"
      [ "${WIDE:-0}" = 1 ] && inter="256 2048"
      for spec in ${BACKENDS:-deepep_ht copy_engine}; do  # NAME or NAME+KEY=VALUE (a --backend-opt)
        b=${spec%%+*}
        opt=()
        [ "$spec" != "$b" ] && opt=(--backend-opt "${spec#*+}")
        run "overlap-$spec-$n" "${OVERLAP_CAP_S:-300}" $tr_ "$n" -m dbo.bench overlap $ov_thin --backend "$b" "${opt[@]}" \
          --intermediate $inter --tokens ${TOKENS:-4096 8192 16384} --time-budget-s "${OVERLAP_BUDGET_S:-240}" \
          ${OVERLAP_ARGS:-} --out "$files/${spec//[+=]/_}"
      done
      run "overlap-compare-$n" 30 python3 -m dbo.bench compare "$files"/*/ --json "$files/compare.json" ;;
    decode)
      for b in ${DECODE_BACKENDS:-deepep_ll}; do
        run "decode-$b-$n" "${DECODE_CAP_S:-240}" $tr_ "$n" -m dbo.bench overlap --device cuda --backend "$b" \
          --intermediate 2048 --tokens ${TOKENS:-32 128 512} --cuda-graph --time-budget-s "${DECODE_BUDGET_S:-200}" \
          --modes $all_modes ${DECODE_ARGS:-} --out "$files/$b"
      done ;;
    link)
      for l in ${LINKS:-50,5 25,10}; do  # prefill: deepep_ht (24 SMs) and copy_engine; then decode
        for b in deepep_ht copy_engine; do
          sms=()
          [ "$b" = deepep_ht ] && sms=(--num-sms 24)
          run "link-$l-$b-$n" "${LINK_CAP_S:-150}" $tr_ "$n" -m dbo.bench overlap $ov_thin --backend "$b" "${sms[@]}" \
            --intermediate ${LINK_INTER:-256 2048} --tokens ${TOKENS:-4096 8192 16384} --link "$l" \
            --remote-fraction 0.875 --steps 6 --time-budget-s "${LINK_BUDGET_S:-120}" ${LINK_ARGS:-} \
            --out "$files/${l/,/_}/$b"
        done
        run "link-$l-compare-$n" 30 python3 -m dbo.bench compare "$files/${l/,/_}"/*/ --json "$files/${l/,/_}/compare.json"
        run "link-$l-decode-$n" "${DECODE_CAP_S:-150}" $tr_ "$n" -m dbo.bench overlap --device cuda --backend deepep_ll \
          --intermediate 2048 --experts $((8 * n)) --tokens ${DECODE_TOKENS:-32 64 128 256 512} --cuda-graph \
          --link "$l" --remote-fraction 0.875 --time-budget-s "${DECODE_BUDGET_S:-110}" --modes $all_modes ${DECODE_ARGS:-} \
          --out "$files/${l/,/_}/deepep_ll"
      done ;;
    emulated)
      if [ "${EMU_TESTS:-1}" = 1 ]; then
        run emulated-tests 200 $pytest_gpu tests/gpu/test_emulated_gpu.py
        run emulated-comm 120 python3 tools/probes/emulated_comm.py --link "${EMU_LINK:-deepep-ib}" --json "$files/comm.json"
      fi
      for ep in ${EMU_EPS:-16 32 64 128 256}; do
        run "emulated-decode-$ep" "${EMU_CAP_S:-150}" python3 -m dbo.bench overlap --device cuda --emulate-ep "$ep" \
          --link "${EMU_LINK:-deepep-ib}" --layers 8 --intermediate 2048 --tokens ${EMU_TOKENS:-32 64 128 256 512} \
          --cuda-graph --modes $all_modes --dbo-sm-carveout ${EMU_DECODE_CARVEOUT:-16} --profile-shape none \
          --time-budget-s "${EMU_BUDGET_S:-120}" ${EMU_ARGS:-} \
          --out "$files/decode_ep$ep"
      done
      if [ "${EMU_PREFILL:-0}" = 1 ]; then
        for ep in ${EMU_PREFILL_EPS:-16 32 64}; do
          run "emulated-prefill-$ep" "${EMU_CAP_S:-150}" python3 -m dbo.bench overlap --device cuda --emulate-ep "$ep" \
            --emulate-layout deepep_ht --link "${EMU_PREFILL_LINK:-deepep-ib-ht}" --layers 8 --attn-width 1024 \
            --intermediate ${EMU_INTER:-2048 256} --tokens ${EMU_PREFILL_TOKENS:-4096 8192 16384} --steps 6 \
            --dbo-sm-carveout ${EMU_PREFILL_CARVEOUTS:-none 8} --profile-shape none \
            --time-budget-s "${EMU_BUDGET_S:-120}" ${EMU_ARGS:-} --out "$files/prefill_ep$ep"
        done
      fi
      if [ "${EMU_VALIDATE:-0}" = 1 ]; then
        for l in ${EMU_VALIDATE_LINKS:-25,10 50,5}; do
          for ep in ${EMU_VALIDATE_EPS:-2 4}; do
            run "emulated-validate-$ep-$l" "${EMU_CAP_S:-150}" python3 -m dbo.bench overlap --device cuda \
              --emulate-ep "$ep" --experts $((8 * ep)) --remote-fraction 0.875 --link "$l" --link-order host \
              --intermediate 2048 --tokens 64 256 512 --cuda-graph --modes compute dbo_compute merged_compute comm \
              serial dbo merged sbo --profile-shape none --time-budget-s "${EMU_BUDGET_S:-120}" ${EMU_ARGS:-} \
              --out "$files/validate_ep${ep}_${l/,/_}"
          done
        done
      fi ;;
    hostsplit)
      hs="--device cuda --emulate-ep ${HS_EP:-32} --emulate-layout deepep_ht --link deepep-ib-ht --layers 8
        --attn-width 1024 --tokens ${HS_TOKENS:-512 4096} --intermediate 2048 --modes serial dbo --steps 10
        --no-autotune --profile-shape none --out /tmp/hostsplit_bench"
      run hostsplit 150 python3 tools/probes/host_split.py --profile-every 4 --find-syncs 3 --out "$files" -- $hs
      if [ -n "${HS_TREE:-}" ]; then
        run hostsplit-tree 120 python3 tools/probes/host_split.py --tree "$HS_TREE" --profile-every 0 -- $hs
      fi ;;
    emulated_hf)
      gen="-m dbo.bench hf-generate --device cuda --steps 3 --warmup 1 --modes plain graph dbo-prefill-graph dbo-graph"
      for r in ${EMU_HF_RUNS:-qwen-prefill qwen-generate dsv3-generate}; do
        case $r in
          qwen-prefill)
            run emulated-hf-qwen-prefill "${EMU_HF_CAP_S:-540}" python3 -m dbo.bench hf-prefill --device cuda \
              --preset qwen3-30b-a3b --emulate-ep 16 --link "${EMU_HF_PREFILL_LINK:-deepep-ib-ht}" \
              --shape 8x2048 16x4096 --expert-schedule split merged --steps 3 --warmup 1 \
              ${EMU_HF_PREFILL_ARGS:---sm-carveout 8} --json "$files/hf_qwen_ep16_prefill.json" ;;
          qwen-generate)
            for b in ${EMU_HF_BATCH:-64 256}; do
              run "emulated-hf-qwen-generate-$b" "${EMU_HF_CAP_S:-540}" python3 $gen --preset qwen3-30b-a3b \
                --emulate-ep 16 --link "${EMU_HF_LINK:-deepep-ib}" --batch "$b" --prompt 512 --new-tokens 64 \
                ${EMU_HF_ARGS:---sm-carveout 8} --json "$files/hf_qwen_ep16_generate_b$b.json"
            done ;;
          dsv3-generate)
            run emulated-hf-dsv3-generate "${EMU_HF_CAP_S:-540}" python3 $gen --preset deepseek-v3 \
              --layers "${EMU_DSV3_LAYERS:-8}" --emulate-ep 64 --link "${EMU_HF_LINK:-deepep-ib}" --batch 256 \
              --prompt 128 --new-tokens 32 ${EMU_HF_ARGS:---sm-carveout 8} --json "$files/hf_dsv3_ep64_generate.json" ;;
          *) echo "=== [emulated_hf] unknown run $r (qwen-prefill qwen-generate dsv3-generate)" | tee -a "$log"
             status=1 ;;
        esac
      done ;;
    onerank)
      run onerank 240 $tr_ 1 -m dbo.bench overlap $ov_thin --backend naive --tokens 4096 16384 \
        --intermediate 256 2048 --time-budget-s 200 --out "$files/prefill"
      run onerank-decode 150 $tr_ 1 -m dbo.bench overlap --device cuda --backend naive --attn-width 1024 \
        --profile-shape none --layers 4 --tokens 64 256 512 --intermediate 2048 --no-autotune \
        --modes compute dbo_compute merged_compute serial dbo merged --time-budget-s 120 --out "$files/decode" ;;
    hf)
      ex="-m dbo.bench hf-prefill --device cuda --steps 3 --warmup 1"
      ckpt=${HF_CKPT:-/tmp/qwen3-30b-a3b-${HF_LAYERS:-48}}
      save=()
      [ -f "$ckpt/config.json" ] || save=(--save-checkpoint "$ckpt")  # every rank writes its share
      run "hf-smoke-$n" 120 $tr_ "$n" $ex --preset tiny-deepseek_v3 --backend naive all2all \
        --shape 4x64 7x32 --unconverted --json "$files/smoke.json"
      run "hf-qwen-$n" "${HF_CAP_S:-420}" $tr_ "$n" $ex --preset qwen3-30b-a3b --layers "${HF_LAYERS:-48}" \
        "${save[@]}" --checkpoint "$ckpt" --hf-all-to-all --backend ${HF_BACKENDS:-copy_engine deepep_ht all2all} \
        --ep-experts ${EP_EXPERTS:-library} --expert-schedule ${HF_SCHEDULES:-auto} --shape ${HF_SHAPES:-8x2048 16x4096} \
        ${HF_ARGS:-} --json "$files/qwen.json" ;;
    generate)
      ckpt=${HF_CKPT:-/tmp/qwen3-30b-a3b-${HF_LAYERS:-48}}
      save=(--checkpoint "$ckpt")
      [ -f "$ckpt/config.json" ] || save=(--save-checkpoint "$ckpt")
      run "generate-$n" "${GEN_CAP_S:-420}" $tr_ "$n" -m dbo.bench hf-generate --device cuda --preset qwen3-30b-a3b \
        --layers "${HF_LAYERS:-48}" "${save[@]}" --batch 64 --prompt 512 --new-tokens 64 --steps "${GEN_STEPS:-1}" --warmup 1 --modes ${GEN_MODES:-plain graph dbo-prefill-graph} \
        --backend ${GEN_BACKENDS:-copy_engine deepep_ht/deepep_ll} --json "$files/generate.json" ;;
    soak)
      ckpt=${HF_CKPT:-/tmp/qwen3-30b-a3b-${HF_LAYERS:-48}}
      save=(--checkpoint "$ckpt")
      [ -f "$ckpt/config.json" ] || save=(--save-checkpoint "$ckpt")
      cap=${SOAK_CAP_S:-540}
      [ "$cap" -gt $((deadline - SECONDS)) ] && cap=$((deadline - SECONDS))
      soak_s=${SOAK_S:-$((cap - 140))}  # the calls end in time for the summary and the teardown
      [ "$soak_s" -lt 10 ] && soak_s=10
      run "soak-$n" "$cap" $tr_ "$n" tests/gpu/run_hf_soak.py --device cuda --preset qwen3-30b-a3b \
        --layers "${HF_LAYERS:-48}" "${save[@]}" --duration-s "$soak_s" ${SOAK_ARGS:-} --json "$files/soak_$n.json" ;;
    *)
      echo "=== unknown step '$step' (see the header of $0)" | tee -a "$log"
      status=1 ;;
  esac
  bundle "$step"
done
echo "=== overall status $status" | tee -a "$log"
exit $status
