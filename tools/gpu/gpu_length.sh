#!/usr/bin/env bash
# The length-mismatch experiment on the GPU machine: train/rollout mismatch against rollout length, one SFT checkpoint, three precision modes
# (configs/length_mismatch.yaml says what the experiment is). From the repo root, after the vLLM kit's two calls:
#
#   bash tools/gpu/gpu_length.sh STAGE...      STAGE: sft | sft-more | modes | floor | plot     e.g. bash tools/gpu/gpu_length.sh sft modes plot
#
#   sft    the warm-start once, in bf16 (warmup.steps SFT steps, then one GRPO step at lr 1e-30 with the native engine,
#          so the export is the SFT policy) -> $WORK/len_sft/export. Skipped when that export exists (a machine that
#          keeps /dev/shm between commands).
#   sft-more  SFT_STEPS (default: the config's warmup.steps) more SFT steps from that export, on new examples (seed + round),
#          into a new export that replaces it (~0.75 s per step on an H200): a longer warm-start over several commands on one
#          machine, until the policy answers.
#   modes  GRPO from that export in each mode of $MODES, rollout.engine=vllm, same seed, tools/gpu/gpu_grpo_run.sh per
#          mode; the modes are dealt round-robin to the GPUs (CUDA_VISIBLE_DEVICES) and the GPUs run side by side
#          -> $OUT/<gpu>/gpu_<mode>.metrics.jsonl and each GPU's table.md.
#   floor  the FP8 floor: jetrl from the same export with rollout.engine=native (the same FP8 flow in a second program:
#          our decode path instead of vLLM's kernels) on GPU 0 -> $OUT/floor/gpu_jetrl_native.metrics.jsonl
#   plot   tools/plot_length_mismatch.py: foil and jetrl against response length, bf16 as the BF16 floor and jetrl_native
#          as the FP8 floor, reward per step -> $OUT/length_mismatch.png and the per-bucket table $OUT/by_length.md
#
# Environment: OUT (default out/gpu_length), WORK (default /dev/shm/jetrl_length), CONFIG (configs/length_mismatch.yaml),
# MODES ("jetrl bf16-train-fp8-rollout bf16"), STEPS (GRPO steps per mode, default 6), SFT_STEPS (warmup.steps, default:
# the config's), RUN_TIMEOUT (per mode run, default 420 s), GPUS (how many to use, default all), ARGS (overrides for
# every run, e.g. "data.multiplier_max=120 rollout.max_new_tokens=1536" for shorter traces; in the SFT stages they come
# before the stage's own settings, so an optim.lr meant for GRPO leaves the SFT export step at its vanishing lr).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_length}
WORK=${WORK:-/dev/shm/jetrl_length}
CONFIG=${CONFIG:-configs/length_mismatch.yaml}
MODES=${MODES:-jetrl bf16-train-fp8-rollout bf16}
STEPS=${STEPS:-6}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
[ $# -gt 0 ] || { echo "usage: bash tools/gpu/gpu_length.sh STAGE... (sft | sft-more | modes | floor | plot)"; exit 2; }
[ -f /tmp/vllm-site/env.sh ] && source /tmp/vllm-site/env.sh
if ! "$PY" -c "import megatron.core, math_verify" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl || exit 3
fi
export PYTHONPATH=/tmp/mcore:$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
sft_dir=$WORK/len_sft
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "${gpus:-0}" -ge 1 ] || gpus=1

need_sft() { [ -f "$sft_dir/export/config.json" ] || { echo "no SFT export in $sft_dir: run the sft stage first"; exit 3; }; }
grpo_from_sft() {  # GPU OUTDIR PORT_BASE [override...]: tools/gpu/gpu_grpo_run.sh for $MODES (and $SUFFIX) from the SFT export
  local gpu=$1 out=$2 port=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu OUT=$out WORK=$WORK/$(basename "$out") PORT_BASE=$port CONFIG=$CONFIG RUN_TIMEOUT=${RUN_TIMEOUT:-420} \
    PYTHON=$PY bash tools/gpu/gpu_grpo_run.sh "model.path=$sft_dir/export" warmup.steps=0 "run.steps=$STEPS" run.checkpoint=false \
    ${ARGS:-} "$@" >/dev/null 2>&1
}

for stage in "$@"; do
  t0=$(date +%s)
  echo "== stage $stage $(date -u +%TZ)"
  case $stage in
    sft)
      if [ -f "$sft_dir/export/config.json" ]; then echo "SFT export already in $sft_dir/export"; else
        sft=(); [ -n "${SFT_STEPS:-}" ] && sft=("warmup.steps=$SFT_STEPS")
        CUDA_VISIBLE_DEVICES=0 MASTER_PORT=29661 "$PY" -m megatron_jetrl.rl.train "$CONFIG" ${ARGS:-} precision.mode=bf16 run.name=len_sft \
          "run.out_dir=$sft_dir" run.steps=1 optim.lr=1e-30 run.export=true rollout.engine=native "${sft[@]}" 2>&1 \
          | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$OUT/sft.log" | tail -15
        cp "$sft_dir/metrics.jsonl" "$OUT/sft.metrics.jsonl" 2>/dev/null
      fi ;;
    sft-more)
      need_sft
      round=$(cat "$sft_dir/round" 2>/dev/null || echo 0); round=$((round + 1))
      sft=(); [ -n "${SFT_STEPS:-}" ] && sft=("warmup.steps=$SFT_STEPS")
      rm -rf "$WORK/len_sft_next"
      CUDA_VISIBLE_DEVICES=0 MASTER_PORT=29662 "$PY" -m megatron_jetrl.rl.train "$CONFIG" ${ARGS:-} precision.mode=bf16 run.name=len_sft \
        "run.out_dir=$WORK/len_sft_next" run.steps=1 optim.lr=1e-30 run.export=true rollout.engine=native \
        "model.path=$sft_dir/export" "run.seed=$((1234 + 1000 * round))" "${sft[@]}" 2>&1 \
        | grep --line-buffered -v -E "UserWarning|warnings.warn" | tee "$OUT/sft_more$round.log" | tail -8
      if [ -f "$WORK/len_sft_next/export/config.json" ]; then
        echo "$round" >"$WORK/len_sft_next/round"
        cp "$WORK/len_sft_next/metrics.jsonl" "$OUT/sft_more$round.metrics.jsonl" 2>/dev/null
        rm -rf "$sft_dir" && mv "$WORK/len_sft_next" "$sft_dir" && echo "SFT round $round -> $sft_dir/export"
      else echo "sft-more round $round wrote no export: $sft_dir keeps the previous one"; exit 3; fi ;;
    floor)
      need_sft
      MODES=jetrl SUFFIX=_native grpo_from_sft 0 "$OUT/floor" 29690 rollout.engine=native
      cat "$OUT/floor/table.md" 2>/dev/null ;;
    modes)
      need_sft
      read -r -a modes <<<"$MODES"
      pids=()
      for ((g = 0; g < gpus; g++)); do
        mine=""
        for ((i = g; i < ${#modes[@]}; i += gpus)); do mine="$mine ${modes[$i]}"; done
        [ -n "$mine" ] || continue
        MODES="$mine" grpo_from_sft "$g" "$OUT/gpu$g" $((29700 + 10 * g)) &
        pids+=($!)
        echo "GPU $g:$mine"
      done
      for p in "${pids[@]}"; do wait "$p"; done
      for ((g = 0; g < gpus; g++)); do [ -f "$OUT/gpu$g/table.md" ] && { echo "-- GPU $g"; cat "$OUT/gpu$g/table.md"; }; done ;;
    plot)
      runs=(); floor=()
      for f in "$OUT"/gpu*/gpu_*.metrics.jsonl "$OUT"/floor/gpu_*.metrics.jsonl; do
        [ -f "$f" ] || continue
        mode=$(basename "$f" .metrics.jsonl); mode=${mode#gpu_}
        case $mode in
          bf16) floor+=(--floor "bf16 (BF16 floor)=$f") ;;
          jetrl_native) floor+=(--floor "jetrl, native engine (FP8 floor)=$f") ;;
          *) runs+=("$mode=$f") ;;
        esac
      done
      "$PY" tools/plot_length_mismatch.py "${runs[@]}" "${floor[@]}" -o "$OUT/length_mismatch.png" --table "$OUT/by_length.md" ;;
    *) echo "unknown stage $stage (sft | sft-more | modes | floor | plot)"; exit 2 ;;
  esac
  echo "== stage $stage done in $(( $(date +%s) - t0 )) s"
done
