#!/usr/bin/env bash
# Multi-GPU runs on one GPU host: 2 GPUs through torchrun, as `launch/train_grpo.sh` starts them (4 with
# ARGS=parallel.dp=2: trainer TP 2 x DP 2; the vllm stage then runs world size / rollout TP engines).
# (SLURM cannot be started on the device machine: it has no network to install it. The sbatch scripts in
# launch/slurm run the same launchers with the same environment; CI runs them under a real slurmctld on CPU.)
#
#   bash tools/gpu/gpu_multi.sh STAGE...      STAGE: setup | tests | overlap | ordered | pipeline | sweep | vllm     e.g. bash tools/gpu/gpu_multi.sh setup sweep
#
#   setup  .whl/*.whl (megatron-core, math-verify) -> /tmp/mcore; DeepGEMM -> /tmp/dg, from .kits/deep_gemm when carried,
#          else the copy the vLLM kit bundles (/tmp/vllm-site/vllm/third_party/deep_gemm, the same files).
#   tests  GPU 0: tools/gpu/run_gpu_tests.sh -k "$TESTS_K" (the FP8 kernels, DeepGEMM, the FP8 linear); then
#          tests/gpu/test_actor_tp_gpu.py (megatron TP 2 on both GPUs against TP 1).
#   overlap tools/bench/bench_sp_overlap.py on every GPU (one TP group, sequence parallel): megatron's BF16 linears against
#          the FP8 ones with each parallel.sp_overlap, checked against none first -> $OUT/sp_overlap.json
#   ordered tools/bench/bench_ordered_reduce.py on every GPU: the rank-order TP sum of exact logprobs (the actor's and
#          vLLM's) against NCCL's all-reduce, per call, checked first; eager, then as CUDA graph replays (vLLM's decode)
#          -> $OUT/ordered_reduce_{eager,graphs}.json
#   pipeline tools/bench/bench_pipeline.py, one pipeline stage per GPU: the update of $PIPE_LAYERS (18) Qwen3-8B layers,
#          the last stage $PIPE_LAST (8) of them, 32 micro-batches of 4 x 1088 tokens, bf16 against jetrl (exact logprobs
#          off: no vLLM), each stage's profiled timeline; then the first stage's layer count as one GPU's whole step
#          (tools/bench/bench_actor.py, GPU 0) -> $OUT/pipeline.json, $OUT/pipeline_one_gpu.json. PIPE_MODES: other
#          variants (e.g. "bf16 jetrl jetrl+model.cuda_graphs=all"); PIPE_ARGS: more bench_pipeline arguments, e.g.
#          "--tp 2 --pp-last-layers 0 --override parallel.sequence_parallel=true" (then no one-GPU run)
#   sweep  launch/tp_sweep.sh --tp "$SWEEP_TP" --modes "$SWEEP_MODES" at configs/gpu_8b_shapes.yaml (Qwen3-8B layer
#          shapes, 8 layers) with the native engine -> $OUT/sweep_report.{md,csv} (the paper's Table 4 with our numbers).
#   vllm   GRPO with rollout.engine=vllm on every rank, trainer TP 2, one run per ROLLOUT_TP:MODE in $RUNS (rollout
#          TP 2: one vLLM TP-2 engine over both GPUs; 1: two TP-1 engines, each sampling half the prompts), same config
#          -> $OUT/vllm_report.{md,csv}. Every sync compares the bytes inside every rank's vLLM with the
#          trainer's and stops the run if one differs, so exit 0 means the check passed on every rank at every step.
# Each run's metrics.jsonl is copied to $OUT/<run>.metrics.jsonl and the last lines of a failed run's log are printed.
#
# Environment: OUT (default out/gpu_multi), WORK (run directories; default /dev/shm/jetrl_multi), STEPS (GRPO steps
# per run, default 4), SWEEP_TP ("1 2"), SWEEP_MODES ("bf16 jetrl"), RUNS ("2:jetrl 2:bf16 1:jetrl 1:bf16
# 2:bf16-train-fp8-rollout"), RUN_TIMEOUT (per run, default 260 s: a cold FP8 vLLM engine spends 50-70 s of its
# start JIT-compiling DeepGEMM kernels; the first jetrl run took 183 s), TOTAL_TIMEOUT (all stages, default 570 s:
# a stage gets what is left), TESTS_K, ARGS (extra overrides for every GRPO run).
# vLLM stages need the vLLM kit unpacked first (shared/kits/README.md: two calls) and source /tmp/vllm-site/env.sh.
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_multi}
WORK=${WORK:-/dev/shm/jetrl_multi}
STEPS=${STEPS:-4}
CONFIG=configs/gpu_8b_shapes.yaml
mkdir -p "$OUT" "$WORK"
[ $# -gt 0 ] || { echo "usage: bash tools/gpu/gpu_multi.sh STAGE... (setup | tests | overlap | ordered | pipeline | sweep | vllm)"; exit 2; }
for stage in "$@"; do
  case $stage in setup|tests|overlap|ordered|pipeline|sweep|vllm) ;; *) echo "unknown stage $stage (setup | tests | overlap | ordered | pipeline | sweep | vllm)"; exit 2 ;; esac
done
T_END=$(( $(date +%s) + ${TOTAL_TIMEOUT:-570} ))
left() { local s=$(( T_END - $(date +%s) - 5 )); [ "$s" -lt 1 ] && s=1; [ "$1" -lt "$s" ] && echo "$1" || echo "$s"; }

export PYTHONPATH=/tmp/mcore:$repo${PYTHONPATH:+:$PYTHONPATH} PYTHON=python3 PYTHONUNBUFFERED=1 \
  CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# DeepGEMM for the trainer: /tmp/dg's `deep_gemm` outside vLLM stages; inside them vLLM's own copy
# (`vllm.third_party.deep_gemm`, the same files): one extension module per process, never both.
with_dg() { PYTHONPATH=/tmp/dg:$PYTHONPATH "$@"; }

setup() {
  if python3 -c "import megatron.core, math_verify" 2>/dev/null; then echo "megatron-core: already importable"
  else python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl && echo "wheels -> /tmp/mcore"; fi
  if [ -f /tmp/dg/deep_gemm/__init__.py ]; then echo "DeepGEMM: already in /tmp/dg"
  elif [ -f .kits/deep_gemm/deep_gemm.tar.xz ]; then mkdir -p /tmp/dg && tar -xJf .kits/deep_gemm/deep_gemm.tar.xz -C /tmp/dg && echo "DeepGEMM: kit -> /tmp/dg"
  elif [ -f /tmp/vllm-site/vllm/third_party/deep_gemm/__init__.py ]; then
    mkdir -p /tmp/dg && ln -sfn /tmp/vllm-site/vllm/third_party/deep_gemm /tmp/dg/deep_gemm && echo "DeepGEMM: vLLM's bundle -> /tmp/dg"
  else echo "DeepGEMM: none (backend auto falls back to cuBLASLt)"; fi
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, 'GPUs', torch.cuda.device_count())"
}

keep() {  # run dir -> $OUT: metrics, and the tail of a failed run's log
  local dir=$1 log=$2 rc=$3 name
  name=$(basename "$dir")
  [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  if [ "$rc" != 0 ]; then echo "-- $name exit $rc; last lines:"; grep -v -E "UserWarning|warnings.warn" "$log" | tail -15; fi
}

vllm_runs() {
  local dirs=() run rtp mode name dir log rc t0
  for run in ${RUNS:-2:jetrl 2:bf16 1:jetrl 1:bf16 2:bf16-train-fp8-rollout}; do
    rtp=${run%%:*}; mode=${run#*:}
    name=multi_tp2_rtp${rtp}_$mode; dir=$WORK/$name; log=$OUT/$name.log
    rm -rf "$dir"; dirs+=("$dir"); t0=$(date +%s)
    if [ $(( T_END - t0 )) -lt 60 ]; then echo "$name: not run (under 60 s left of TOTAL_TIMEOUT)"; continue; fi
    timeout -k 15 "$(left "${RUN_TIMEOUT:-260}")" bash launch/train_grpo.sh "$CONFIG" parallel.tp=2 rollout.engine=vllm \
      "rollout.tp=$rtp" "precision.mode=$mode" "run.steps=$STEPS" "run.name=$name" "run.out_dir=$dir" ${ARGS:-} >"$log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - t0 )) s"
    keep "$dir" "$log" "$rc"
  done
  python3 tools/sweep_report.py "${dirs[@]}" -o "$OUT/vllm_report"
}

for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    setup) setup 2>&1 | tee "$OUT/setup.log" ;;
    tests)
      CUDA_VISIBLE_DEVICES=0 with_dg timeout "$(left 300)" bash tools/gpu/run_gpu_tests.sh -k "${TESTS_K:-kernels or fp8 or deepgemm}" \
        2>&1 | tee "$OUT/tests_gpu0.log" | grep -E "passed|failed|Error|FAILED" | tail -15
      with_dg timeout "$(left 240)" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_actor_tp_gpu.py 2>&1 \
        | tee "$OUT/tests_tp2.log" | grep -E "passed|failed|Error|FAILED|skipped" | tail -15 ;;
    overlap)
      with_dg timeout -k 15 "$(left 300)" torchrun --nproc-per-node="$(nvidia-smi -L | wc -l)" tools/bench/bench_sp_overlap.py \
        --json "$OUT/sp_overlap.json" 2>&1 | grep -v -E "UserWarning|warnings.warn" | tee "$OUT/sp_overlap.log" | tail -15 ;;
    ordered)
      for how in eager graphs; do
        extra=(); [ "$how" = graphs ] && extra=(--graphs)
        timeout -k 15 "$(left 150)" torchrun --nproc-per-node="$(nvidia-smi -L | wc -l)" tools/bench/bench_ordered_reduce.py \
          "${extra[@]}" --json "$OUT/ordered_reduce_$how.json" 2>&1 | grep -v -E "UserWarning|warnings.warn|deprecated|return func" \
          | tee "$OUT/ordered_reduce_$how.log" | tail -10
      done ;;
    pipeline)
      n=$(nvidia-smi -L | wc -l); shape=(--seq 1088 --micro-batch 4 --micro-batches 32 --override precision.exact_logprobs=false)
      with_dg timeout -k 15 "$(left 360)" torchrun --nproc-per-node="$n" tools/bench/bench_pipeline.py --layers "${PIPE_LAYERS:-18}" \
        --pp-last-layers "${PIPE_LAST:-8}" "${shape[@]}" --modes ${PIPE_MODES:-bf16 jetrl} ${PIPE_ARGS:-} --profile \
        --json "$OUT/pipeline.json" 2>&1 | grep -v -E "UserWarning|warnings.warn" | tee "$OUT/pipeline.log" | tail -30
      last=${PIPE_LAST:-8}; first=$(( last ? (${PIPE_LAYERS:-18} - last) / (n - 1) : ${PIPE_LAYERS:-18} / n ))
      [ -n "${PIPE_ARGS:-}" ] || CUDA_VISIBLE_DEVICES=0 with_dg timeout -k 15 "$(left 240)" python3 tools/bench/bench_actor.py \
        --layers "$first" "${shape[@]}" --warmup 1 --steps 2 --step-profile --json "$OUT/pipeline_one_gpu.json" 2>&1 \
        | grep -v -E "UserWarning|warnings.warn" | tee "$OUT/pipeline_one_gpu.log" | tail -12 ;;
    sweep)
      with_dg timeout -k 15 "$(left 420)" bash launch/tp_sweep.sh --tp "${SWEEP_TP:-1 2}" --modes "${SWEEP_MODES:-bf16 jetrl}" \
        --steps "$STEPS" --out "$WORK/sweep" "$CONFIG" ${ARGS:-} 2>&1 | grep -v -E "UserWarning|warnings.warn" | tee "$OUT/sweep.log" | tail -30
      cp "$WORK"/sweep/sweep_report.md "$WORK"/sweep/sweep_report.csv "$OUT"/ 2>/dev/null
      for d in "$WORK"/sweep/sweep_tp*/; do [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$OUT/$(basename "$d").metrics.jsonl"; done ;;
    vllm)
      bash .kits/vllm/unpack.sh --need-complete >/dev/null 2>&1 || [ "$(ls /tmp/vllm-site/.kit/*.sha256 2>/dev/null | wc -l)" -ge 2 ] \
        || { echo "the vLLM kit is not unpacked whole (shared/kits/README.md: two calls)"; exit 3; }
      source /tmp/vllm-site/env.sh
      vllm_runs 2>&1 | tee "$OUT/vllm.log" ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
