#!/usr/bin/env bash
# Qwen3-8B end to end on one node of 4 GPUs (configs/models/qwen3-8b-base.yaml + configs/e2e_8b.yaml): the precision
# modes side by side in one layout, the pipeline layouts, and the 4-GPU tests.
#
#   bash tools/gpu/gpu_e2e.sh STAGE...     STAGE: setup | warm | e2e | pp | tests | jit-save
#
#   setup     .whl/*.whl -> /tmp/mcore when megatron-core is missing; the vLLM kit must be unpacked (shared/kits/README.md);
#             a carried .cache/jit/deep_gemm_jit.tgz -> the DeepGEMM caches (tools/gpu/jit_cache.sh load)
#   warm      python -m megatron_jetrl.rl.warm_gemms for the e2e layout, and for the pp stage's when it runs (the FP8
#             kernels they run)
#   e2e       one GRPO run per mode in $MODES at $LAYOUT (default: configs/e2e_8b.yaml's own, TP 1 x PP 4 split
#             10 + 10 + 10 + 6 with rollout TP 1), responses of $LEN tokens
#   pp        the same for each layout of $PP_LAYOUTS (';'-separated; default TP 2 x PP 2 with rollout TP 2: two engines,
#             each holding the whole model), modes $PP_MODES
#   tests     tests/gpu/test_grpo_4gpu.py (sync bytes at TP 4 and TP 2 x PP 2, PP exactness, a killed stage), or the
#             pytest arguments in $TESTS (TESTS="tests/gpu/test_exact_logprobs.py -k several_gpus": mismatch 0 at TP 4)
#   jit-save  the DeepGEMM cache -> $OUT/deep_gemm_jit.tgz (tools/gpu/jit_cache.sh)
# A layout names the keys it changes; every other parallel key is PP 1, even, DP 1 (LAYOUT="parallel.tp=4
# rollout.tp=4" is TP 4 alone). Per run: <name>.log and <name>.metrics.jsonl in $OUT, and <name>.mem: every GPU's used
# memory (MiB) sampled each second by nvidia-smi (also the run directory's gpu_memory.csv). Then tools/sweep_report.py
# over the runs of the stage -> $OUT/<stage>_<layout>_<len>_report.{md,csv}: per-phase medians, speedups over bf16,
# mismatch, peak GPU memory.
#
# Environment: OUT (default out/gpu_e2e), WORK (run directories, default /dev/shm/jetrl_e2e), STEPS (default 3),
# LEN (1024; above it configs/e2e_8b_long.yaml joins the configs: 128 sequences a step), MODES ("bf16 jetrl bf16-train-fp8-rollout"), PP_MODES ("bf16 jetrl"), LAYOUT, RUN_TIMEOUT (900 s),
# ARGS (extra overrides for every run), VARIANT (a tag in every run's name, so runs of other ARGS keep their own
# directories and report: VARIANT=graphs ARGS="model.cuda_graphs=all"). Micro-batches follow LEN: about 4K response tokens each (4 x 1024: the first
# of 4 pipeline stages keeps 4 in flight), the forward-only logprob passes twice that. Where the time of each phase
# goes: STEPS=4 ARGS="run.profile_step=3" profiles the last step's eval and update on every rank (rl.profiling;
# <name>_profile_step3_rank<R>.json in $OUT; the report's medians leave that step out; tools/profile_report.py compares
# the modes -> <stage>_<layout>_<len>_profile.md).
# Larger sweeps: LAYOUT="parallel.tp=2 parallel.dp=2 rollout.tp=2" (TP 2 x DP 2, distributed optimizer; with
# ARGS="rollout.offload=optimizer grpo.logprob_micro_batch_size=16": without the offload the first sync runs out of
# memory beside the TP 2 engines); LEN=4096 or 8192 (on an 80 GB card with ARGS="rollout.offload=optimizer": the
# actor's grads, optimizer state and FP8 weight copies leave the GPU while the engine is awake, and the KV cache a step
# of long rollouts needs gets that memory); PP_LAYOUTS="parallel.tp=4 rollout.tp=4;parallel.tp=2 parallel.pp=2 rollout.tp=2;parallel.tp=1
# parallel.pp=4 rollout.tp=1" (PP 1, 2 and 4 of the 36 layers, as in BENCHMARKS.md: at PP 4 each GPU's engine holds the
# whole model beside a quarter of the actor's state; bf16 peaked at 75.4 GiB there with 512-token responses. 48 layers,
# 61 GiB of actor state by the preflight's count, leave a BF16 engine no room).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_e2e}
WORK=${WORK:-/dev/shm/jetrl_e2e}
LEN=${LEN:-1024}
CONFIGS=(configs/models/qwen3-8b-base.yaml configs/e2e_8b.yaml)
[ "$LEN" -gt 1024 ] && CONFIGS+=(configs/e2e_8b_long.yaml)  # the long rollouts: 128 sequences a step
mkdir -p "$OUT" "$WORK"
[ $# -gt 0 ] || { echo "usage: bash tools/gpu/gpu_e2e.sh STAGE... (setup | warm | e2e | pp | tests | jit-save)"; exit 2; }
export PYTHONPATH=/tmp/mcore:$repo${PYTHONPATH:+:$PYTHONPATH} PYTHON=python3 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

length_args() {  # responses of $1 tokens: micro-batches of about 4K response tokens (a power of two: it divides the step),
  # the forward-only logprob passes 2x that (configs/e2e_8b.yaml at 1024)
  local mbs=8; while [ $(( mbs * $1 )) -gt 4096 ] && [ "$mbs" -gt 1 ]; do mbs=$(( mbs / 2 )); done
  echo "rollout.max_new_tokens=$1 rollout.max_model_len=$(( $1 + 64 )) grpo.micro_batch_size=$mbs grpo.logprob_micro_batch_size=$(( 2 * mbs ))"
}

E2E_LAYOUT="parallel.tp=1 parallel.pp=4 rollout.tp=1 parallel.pp_last_layers=6"  # configs/e2e_8b.yaml's own
ONE_STAGE="parallel.pp=1 parallel.pp_last_layers=0 parallel.dp=1"  # what a layout string does not name

run() {  # NAME OVERRIDES...: one GRPO run with GPU memory sampled; metrics, log and memory samples -> $OUT
  local name=$1 dir=$WORK/$1 smi rc t0; shift
  rm -rf "$dir"; t0=$(date +%s)
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 >"$OUT/$name.mem" 2>/dev/null & smi=$!
  timeout -k 20 "${RUN_TIMEOUT:-900}" bash launch/train_grpo.sh "${CONFIGS[@]}" "$@" "run.name=$name" "run.out_dir=$dir" \
    ${ARGS:-} >"$OUT/$name.log" 2>&1
  rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  [ -f "$dir/config.yaml" ] && cp "$dir/config.yaml" "$OUT/$name.config.yaml"
  for f in "$dir"/profile_step*_rank*.json; do [ -f "$f" ] && cp "$f" "$OUT/${name}_$(basename "$f")"; done
  [ -d "$dir" ] && cp "$OUT/$name.mem" "$dir/gpu_memory.csv"  # the report's peak GPU memory column
  [ -d "$dir" ] && echo "{\"rc\": $rc}" >"$dir/sweep_status.json"
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s; peak MiB per GPU: $(awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "%s:%s ", g, m[g]}' "$OUT/$name.mem")"
  [ "$rc" = 0 ] || grep -v -E "UserWarning|warnings.warn" "$OUT/$name.log" | tail -12
}

modes() {  # STAGE LAYOUT_TAG MODES OVERRIDES...
  local stage=$1 tag=$2 mode dirs=(); shift 2
  local list=$1; shift
  for mode in $list; do
    run "${stage}_${tag}${VARIANT:+_$VARIANT}_${LEN}_$mode" "precision.mode=$mode" "run.steps=${STEPS:-3}" $(length_args "$LEN") $ONE_STAGE "$@"
    dirs+=("$WORK/${stage}_${tag}${VARIANT:+_$VARIANT}_${LEN}_$mode")
  done
  tag=$tag${VARIANT:+_$VARIANT}
  python3 tools/sweep_report.py "${dirs[@]}" -o "$OUT/${stage}_${tag}_${LEN}_report"
  local profiled=() d; for d in "${dirs[@]}"; do compgen -G "$d/profile_step*_rank0.json" >/dev/null && profiled+=("$d"); done
  [ ${#profiled[@]} -eq 0 ] || python3 tools/profile_report.py "${profiled[@]}" -o "$OUT/${stage}_${tag}_${LEN}_profile"
}

tag_of() {  # "parallel.tp=2 parallel.pp=2 rollout.tp=2" -> tp2pp2rtp2 ("... model.spec=te" -> tp2pp2rtp2te,
  # "... precision.gemm_sms=116" -> tp2pp2rtp2gemm_sms116)
  echo "$1" | sed 's/rollout\.tp=/rtp/; s/model\.spec=//; s/parallel\.//g; s/precision\.//g; s/=//g; s/ //g'
}

for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    setup)
      python3 -c "import megatron.core, math_verify" 2>/dev/null \
        || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl
      python3 -c "import vllm" 2>/dev/null || { echo "vLLM is not importable: unpack the kit, source /tmp/vllm-site/env.sh"; exit 3; }
      bash tools/gpu/jit_cache.sh load
      nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader ;;
    warm)
      layouts=("${LAYOUT:-$E2E_LAYOUT}")  # the pp stage's layouts only when it runs
      [[ " $* " == *" pp "* ]] && IFS=';' read -r -a more <<<"${PP_LAYOUTS:-parallel.tp=2 parallel.pp=2 rollout.tp=2}" && layouts+=("${more[@]}")
      for layout in "${layouts[@]}"; do
        python3 -m megatron_jetrl.rl.warm_gemms "${CONFIGS[@]}" precision.mode=jetrl $(length_args "$LEN") $ONE_STAGE $layout ${ARGS:-} 2>&1 \
          | grep -v -E "UserWarning|warnings.warn" | tail -4
      done
      if [[ " $* " == *" tests "* ]]; then  # the tests' native engine, only when they run
        python3 -m megatron_jetrl.rl.warm_gemms configs/gpu_8b_shapes.yaml rollout.engine=native parallel.tp=2 \
          grpo.micro_batch_size=16 2>&1 | grep -v -E "UserWarning|warnings.warn" | tail -2
      fi ;;
    e2e) modes e2e "$(tag_of "${LAYOUT:-$E2E_LAYOUT}")" "${MODES:-bf16 jetrl bf16-train-fp8-rollout}" ${LAYOUT:-$E2E_LAYOUT} ;;
    pp)
      IFS=';' read -r -a layouts <<<"${PP_LAYOUTS:-parallel.tp=2 parallel.pp=2 rollout.tp=2}"
      for layout in "${layouts[@]}"; do modes pp "$(tag_of "$layout")" "${PP_MODES:-bf16 jetrl}" $layout; done ;;
    tests) python3 -m pytest -q -p no:cacheprovider -rA ${TESTS:-tests/gpu/test_grpo_4gpu.py} --basetemp="$WORK/pytest" 2>&1 \
             | grep -v -E "UserWarning|warnings.warn" | tee "$OUT/tests_4gpu.log" | tail -40 ;;
    jit-save) bash tools/gpu/jit_cache.sh save "$OUT" ;;
    *) echo "unknown stage $stage (setup | warm | e2e | pp | tests | jit-save)"; exit 2 ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
