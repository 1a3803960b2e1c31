#!/usr/bin/env bash
# Precision modes side by side from one warm-start: does jetrl learn like BF16, and does the foil fall behind?
#
#   bash launch/compare_modes.sh [--modes "bf16 bf16-train-fp8-rollout jetrl"] [--out runs/compare] [--gpus N]
#                                [--] [CONFIG.yaml] [section.key=value ...]
#   bash launch/compare_modes.sh --modes "bf16 bf16-train-fp8-rollout jetrl jetrl-exact" configs/learning_curves.yaml
#
# 1. warm-start: the config's SFT once, in bf16 (`run.steps=0 run.export=true`) -> OUT/sft/export; skipped when that
#    export exists, so every mode (and every later launch) starts from the same policy.
# 2. modes: one GRPO run per mode from that export (`model.path=OUT/sft/export warmup.steps=0`), same seed, same data,
#    side by side. Each mode takes parallel.world_size GPUs of this node (CUDA_VISIBLE_DEVICES); with more modes than
#    GPU groups, group g runs modes g, g + groups, ... one after another; without GPUs every mode runs at once on the CPU
#    (the cores split between them). Modes: bf16 | bf16-train-fp8-rollout | jetrl (exact logprobs off, even where
#    jetrl's default turns them on) | jetrl-exact (jetrl with precision.exact_logprobs=true). Run directory OUT/<mode>, log OUT/<mode>.log. Launched again (e.g. with a larger
#    run.steps, or after a stop), each mode resumes from its newest checkpoint (run.save_every) and a finished one says so.
# 3. report: tools/plot_learning.py OUT/<mode>... -> OUT/learning_curves.png (reward, held-out accuracy, mismatch,
#    sequence log ratio by length, TIS weights, clip fraction, response length) and OUT/learning_curves.md.
#
# Every mode's config is resolved before anything starts: one the config refuses stops the launch (exit 2) with its
# message. Exit status: 0 every mode reached run.steps; 1 the warm-start or a mode failed (the report is written from
# what ran); 2 bad arguments or a refused config.
# Environment: MODES, COMPARE_OUT (default runs/compare), JETRL_GPUS (GPUs to use; default all that nvidia-smi lists, 0
# on a machine without), PYTHON (see launch/python.sh).
set -euo pipefail

script=$(readlink -f "${BASH_SOURCE[0]}")
repo=$(dirname "$(dirname "$script")")
die() {
  echo "compare_modes.sh: error: $*" >&2
  exit 2
}

modes=${MODES:-bf16 bf16-train-fp8-rollout jetrl}
out=${COMPARE_OUT:-runs/compare}
gpus=${JETRL_GPUS:-}
while [ $# -gt 0 ]; do
  case $1 in
    --modes) [ $# -ge 2 ] || die "--modes needs a value"; modes=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a value"; out=$2; shift 2 ;;
    --gpus) [ $# -ge 2 ] || die "--gpus needs a value"; gpus=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$script" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
read -r -a mode_list <<<"$modes"
[ ${#mode_list[@]} -gt 0 ] || die "no modes given"
config=()
if [ $# -gt 0 ] && [[ $1 != *=* ]]; then
  config=("$1")
  shift
fi
overrides=("$@")
if [ -z "$gpus" ]; then
  gpus=0
  command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
[[ $gpus =~ ^[0-9]+$ ]] || die "--gpus '$gpus' is not a number"

py=$(bash "$repo/launch/python.sh")
export PYTHON=$py
case ":${PYTHONPATH:-}:" in
  *":$repo:"*) ;;
  *) export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
out=$(realpath -m "$out")  # made once the modes' configs are checked: a refused comparison writes nothing
sft=$out/sft

mode_args() {  # MODE -> the overrides that make it
  case $1 in
    bf16|bf16-train-fp8-rollout) echo "precision.mode=$1" ;;
    jetrl) echo "precision.mode=jetrl precision.exact_logprobs=false" ;;
    jetrl-exact) echo "precision.mode=jetrl precision.exact_logprobs=true" ;;
    *) return 1 ;;
  esac
}
world=""
config_err=$(mktemp "${TMPDIR:-/tmp}/compare_modes-config.XXXXXX")
trap 'rm -f "$config_err"' EXIT
for mode in "${mode_list[@]}"; do
  extra=$(mode_args "$mode") || die "unknown mode '$mode': use bf16, bf16-train-fp8-rollout, jetrl or jetrl-exact"
  # shellcheck disable=SC2086  # the mode's overrides, word-split
  w_rc=0
  w=$("$py" -m megatron_jetrl.rl.config "${config[@]}" "${overrides[@]}" warmup.steps=0 $extra --get parallel.world_size 2>"$config_err") || w_rc=$?
  if [ "$w_rc" -eq 2 ]; then cat "$config_err" >&2; exit 2; fi  # a config error: its own message, nothing else
  [ "$w_rc" -eq 0 ] || die "mode $mode: $(grep -v '^[[:space:]]*$' "$config_err" | tail -n 1)"
  w=$(tail -n 1 <<<"$w" | tr -d '[:space:]')
  [ -z "$world" ] || [ "$w" = "$world" ] || die "mode $mode needs $w processes, the others $world: give every mode one layout"
  world=$w
done
mkdir -p "$out"
if [ "$gpus" -gt 0 ]; then
  groups=$((gpus / world))
  [ "$groups" -ge 1 ] || die "each mode needs $world GPUs (parallel.world_size), this node has $gpus"
else
  groups=${#mode_list[@]}
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  threads=$((cores / (groups * world)))
  export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
fi
echo "compare_modes.sh: modes {${mode_list[*]}}, $world process(es) each, $groups at a time ($([ "$gpus" -gt 0 ] && echo "$gpus GPUs" || echo "CPU")), out $out"

rc=0
if [ -f "$sft/export/config.json" ]; then
  echo "compare_modes.sh: warm-start: $sft/export exists, reused"
else
  echo "compare_modes.sh: warm-start (bf16 SFT) -> $sft/export, log $out/sft.log"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((world - 1))) bash "$repo/launch/train_grpo.sh" "${config[@]}" "${overrides[@]}" \
    precision.mode=bf16 run.steps=0 run.checkpoint=true run.export=true run.name=sft "run.out_dir=$sft" >"$out/sft.log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && [ -f "$sft/export/config.json" ] || {
    echo "compare_modes.sh: the warm-start failed (exit $rc); last lines of $out/sft.log:" >&2
    tail -n 15 "$out/sft.log" | sed 's/^/    /' >&2
    exit 1
  }
fi

run_group() {  # GROUP: its modes one after another on its GPUs; a failure is written to OUT/<mode>.failed
  local g=$1 i mode devices=""
  [ "$gpus" -gt 0 ] && devices=$(seq -s, $((g * world)) $((g * world + world - 1)))
  for ((i = g; i < ${#mode_list[@]}; i += groups)); do
    mode=${mode_list[$i]}
    read -r -a extra <<<"$(mode_args "$mode")"
    args=("${config[@]}" "${overrides[@]}" "model.path=$sft/export" warmup.steps=0 "${extra[@]}" "run.name=$mode" "run.out_dir=$out/$mode")
    rm -f "$out/$mode.failed"
    echo "compare_modes.sh: $mode on ${devices:-the CPU}, log $out/$mode.log"
    if CUDA_VISIBLE_DEVICES=$devices bash "$repo/launch/train_grpo.sh" "${args[@]}" >>"$out/$mode.log" 2>&1; then
      echo "compare_modes.sh: $mode: done"
    else
      echo "exit $?" >"$out/$mode.failed"
      echo "compare_modes.sh: $mode: FAILED; last lines of $out/$mode.log:" >&2
      tail -n 15 "$out/$mode.log" | sed 's/^/    /' >&2
    fi
  done
}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; echo "compare_modes.sh: interrupted" >&2; exit 143' TERM INT HUP
for ((g = 0; g < groups && g < ${#mode_list[@]}; g++)); do
  run_group "$g" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done

dirs=()
for mode in "${mode_list[@]}"; do
  [ -f "$out/$mode.failed" ] && rc=1
  dirs+=("$mode=$out/$mode")
done
"$py" "$repo/tools/plot_learning.py" "${dirs[@]}" -o "$out/learning_curves.png" --table "$out/learning_curves.md" || rc=1
exit "$rc"
