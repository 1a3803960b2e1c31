#!/usr/bin/env bash
# Tensor-parallel x precision-mode sweep: one short GRPO run per (TP, mode), then a Table-4-style report.
#
#   bash launch/tp_sweep.sh [--tp "1 2 4 8"] [--modes "bf16 bf16-train-fp8-rollout jetrl"] [--steps 4]
#                           [--out runs] [--max-procs N] [--] [CONFIG.yaml] [section.key=value ...]
#
# Each run is `launch/train_grpo.sh [CONFIG] run.steps=STEPS [overrides...] parallel.tp=TP [rollout.tp=TP with vLLM engines] precision.mode=MODE
# run.name=sweep_tp<TP>_<MODE> run.out_dir=<OUT>/sweep_tp<TP>_<MODE>` (your overrides may change run.steps; the
# sweep owns both TPs -- trainer and engines split alike -- and the mode, name and out_dir). A run directory left by an earlier sweep is deleted first, so no run
# resumes from or mixes with old metrics. With vLLM engines jetrl's default runs exact logprobs at TP 1 and 2 and not
# beyond (precision.exact_logprobs: auto); pass precision.exact_logprobs=false (or true) to hold it fixed across the
# columns. Each run's log: <OUT>/sweep_tp<TP>_<MODE>.log; its exit code and status:
# <run dir>/sweep_status.json; on a GPU node, every GPU's used memory sampled each second: <run dir>/gpu_memory.csv.
#
# Before each run the config module resolves it (`--get parallel.world_size`). A (TP, mode) the config refuses
# (e.g. a TP that does not divide the model's KV heads) is not run and appears in the report as "invalid" with
# the config's message; one whose world size exceeds the processes available is skipped with a message and
# appears as "skipped". Available processes: --max-procs / JETRL_MAX_PROCS, else the GPUs of this node
# (SLURM_GPUS_ON_NODE, else `nvidia-smi -L`), else the CPUs (SLURM_CPUS_ON_NODE, else nproc).
#
# Then `python tools/sweep_report.py <run dirs> -o <OUT>/sweep_report` prints the table and writes
# <OUT>/sweep_report.md and .csv. Exit status: 0 when no run failed and at least one ran, 1 otherwise (the report
# is written either way), 2 bad arguments.
#
# Environment: TP_SIZES, MODES, SWEEP_STEPS (default 4), SWEEP_OUT (default runs), JETRL_MAX_PROCS,
# PYTHON, JETRL_TRAIN_MODULE / JETRL_CONFIG_MODULE (see launch/train_grpo.sh), JETRL_SWEEP_LAUNCH (the command
# starting one run, word-split; default "bash <repo>/launch/train_grpo.sh").
set -euo pipefail

script=$(readlink -f "${BASH_SOURCE[0]}")
repo=$(dirname "$(dirname "$script")")

die() {
  echo "tp_sweep.sh: error: $*" >&2
  exit 2
}

tp_sizes=${TP_SIZES:-1 2 4 8}
modes=${MODES:-bf16 bf16-train-fp8-rollout jetrl}
steps=${SWEEP_STEPS:-4}
out=${SWEEP_OUT:-runs}
max_procs=${JETRL_MAX_PROCS:-}
while [ $# -gt 0 ]; do
  case $1 in
    --tp) [ $# -ge 2 ] || die "--tp needs a value"; tp_sizes=$2; shift 2 ;;
    --tp=*) tp_sizes=${1#*=}; shift ;;
    --modes) [ $# -ge 2 ] || die "--modes needs a value"; modes=$2; shift 2 ;;
    --modes=*) modes=${1#*=}; shift ;;
    --steps) [ $# -ge 2 ] || die "--steps needs a value"; steps=$2; shift 2 ;;
    --steps=*) steps=${1#*=}; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a value"; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --max-procs) [ $# -ge 2 ] || die "--max-procs needs a value"; max_procs=$2; shift 2 ;;
    --max-procs=*) max_procs=${1#*=}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$script" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
read -r -a tp_list <<<"$tp_sizes"
read -r -a mode_list <<<"$modes"
[ ${#tp_list[@]} -gt 0 ] || die "no TP sizes given"
[ ${#mode_list[@]} -gt 0 ] || die "no precision modes given"
for tp in "${tp_list[@]}"; do
  [[ $tp =~ ^[1-9][0-9]*$ ]] || die "TP size '$tp' is not a positive integer"
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps '$steps' is not a positive integer"

# A leading argument that is not section.key=value is the config file.
config=()
if [ $# -gt 0 ] && [[ $1 != *=* ]]; then
  config=("$1")
  shift
fi
overrides=("$@")

py=$(bash "$repo/launch/python.sh")
export PYTHON=$py
command -v "$py" >/dev/null 2>&1 || die "python interpreter '$py' not found; set PYTHON=/path/to/python or run 'bash tools/setup.sh' to create $repo/.venv"
config_module=$(bash "$repo/launch/python.sh" modules | sed -n 2p)
case $config_module in
  *.py) config_cmd=("$py" "$config_module") ;;
  *) config_cmd=("$py" -m "$config_module") ;;
esac
case ":${PYTHONPATH:-}:" in
  *":$repo:"*) ;;
  *) export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
if [ -n "${JETRL_SWEEP_LAUNCH:-}" ]; then
  read -r -a launch <<<"$JETRL_SWEEP_LAUNCH"
else
  launch=(bash "$repo/launch/train_grpo.sh")
fi

if [ -n "$max_procs" ]; then
  procs_source="--max-procs/JETRL_MAX_PROCS"
elif [[ ${SLURM_GPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ ]]; then
  max_procs=$SLURM_GPUS_ON_NODE
  procs_source="GPUs of this SLURM node"
elif command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -gt 0 ]; then
  max_procs=$(nvidia-smi -L | grep -c '^GPU')
  procs_source="GPUs (nvidia-smi)"
elif [[ ${SLURM_CPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ ]]; then
  max_procs=$SLURM_CPUS_ON_NODE
  procs_source="CPUs of this SLURM node"
else
  max_procs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_* otherwise
  procs_source="CPUs (nproc)"
fi
[[ $max_procs =~ ^[1-9][0-9]*$ ]] || die "--max-procs '$max_procs' is not a positive integer"

# The arguments every run shares, validated once (not the machine: that is each run's question below): a config error
# there, such as a misspelt key, would refuse every run, so it is said alone, before anything is written.
base_err=$(mktemp "${TMPDIR:-/tmp}/tp_sweep-config.XXXXXX")
base_rc=0
"${config_cmd[@]}" "${config[@]}" "${overrides[@]}" >/dev/null 2>"$base_err" || base_rc=$?
if [ "$base_rc" -eq 2 ]; then
  cat "$base_err" >&2
  rm -f "$base_err"
  exit 2
fi
rm -f "$base_err"

mkdir -p "$out"
echo "tp_sweep.sh: TP {${tp_list[*]}} x modes {${mode_list[*]}}, $steps step(s) each, up to $max_procs processes ($procs_source), out $out"

# status file: sweep_status.json in the run directory (written after the run; the trainer owns the rest)
write_status() {  # dir status tp mode rc reason log seconds
  mkdir -p "$1"
  "$py" -c 'import json, sys
d, status, tp, mode, rc, reason, log, seconds = sys.argv[1:]
json.dump({"status": status, "tp": int(tp), "mode": mode, "rc": None if rc == "" else int(rc), "reason": reason,
           "log": log, "seconds": int(seconds)}, open(d + "/sweep_status.json", "w"))' "$@"
}

# vLLM engines split as the trainer does (rollout.tp = parallel.tp); the native engine is not tensor parallel
engine=$("${config_cmd[@]}" "${config[@]}" "${overrides[@]}" --get rollout.engine 2>/dev/null | tail -n 1 | tr -d '[:space:]') || engine=""
engine_tp=()
[ "$engine" = vllm ] && engine_tp=("rollout.tp=TP")

run_pid=""
trap '[ -z "$run_pid" ] || kill -TERM "$run_pid" 2>/dev/null; echo "tp_sweep.sh: interrupted" >&2; exit 143' TERM INT HUP
dirs=()
failed=()
skipped=()
invalid=()
ran=0
for tp in "${tp_list[@]}"; do
  for mode in "${mode_list[@]}"; do
    name=sweep_tp${tp}_${mode}
    dir=$out/$name
    log=$out/$name.log
    dirs+=("$dir")
    rm -rf "$dir"
    args=("${config[@]}" "run.steps=$steps" "${overrides[@]}" "parallel.tp=$tp" "${engine_tp[@]/TP/$tp}" "precision.mode=$mode" "run.name=$name" "run.out_dir=$dir")
    world_rc=0
    world=$("${config_cmd[@]}" "${args[@]}" --get parallel.world_size 2>"$log") || world_rc=$?
    world=$(printf '%s' "$world" | tail -n 1 | tr -d '[:space:]')
    if [ "$world_rc" -ne 0 ] || ! [[ $world =~ ^[1-9][0-9]*$ ]]; then
      why=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
      why=${why:-"--get parallel.world_size exited $world_rc, printed '$world'"}
      echo "tp_sweep.sh: $name: invalid, not run: $why"
      write_status "$dir" invalid "$tp" "$mode" "" "$why" "$log" 0
      invalid+=("$name")
      continue
    fi
    if [ "$world" -gt "$max_procs" ]; then
      echo "tp_sweep.sh: $name: skipped: needs $world processes, $max_procs available ($procs_source)"
      write_status "$dir" skipped "$tp" "$mode" "" "needs $world processes, $max_procs available" "" 0
      skipped+=("$name")
      continue
    fi
    echo "tp_sweep.sh: $name: $world process(es), log $log"
    start=$(date +%s)
    rc=0
    smi_pid=""
    if command -v nvidia-smi >/dev/null 2>&1; then  # every GPU's used memory each second: the report's peak column
      nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 >"$out/$name.gpu_memory.csv" 2>/dev/null &
      smi_pid=$!
    fi
    "${launch[@]}" "${args[@]}" >"$log" 2>&1 &  # background: a signal to the sweep is passed on at once (trap below)
    run_pid=$!
    wait "$run_pid" || rc=$?
    while kill -0 "$run_pid" 2>/dev/null; do
      rc=0
      wait "$run_pid" || rc=$?
    done
    run_pid=""
    if [ -n "$smi_pid" ]; then
      kill "$smi_pid" 2>/dev/null || true; wait "$smi_pid" 2>/dev/null || true
      mkdir -p "$dir" && mv "$out/$name.gpu_memory.csv" "$dir/gpu_memory.csv"
    fi
    seconds=$(($(date +%s) - start))
    ran=$((ran + 1))
    if [ "$rc" -eq 0 ]; then
      echo "tp_sweep.sh: $name: ok in ${seconds}s"
      write_status "$dir" ok "$tp" "$mode" 0 "" "$log" "$seconds"
    else
      echo "tp_sweep.sh: $name: FAILED with exit code $rc in ${seconds}s; last lines of $log:" >&2
      tail -n 15 "$log" | sed 's/^/    /' >&2
      write_status "$dir" failed "$tp" "$mode" "$rc" "exit code $rc" "$log" "$seconds"
      failed+=("$name")
    fi
  done
done

report_rc=0
"$py" "$repo/tools/sweep_report.py" "${dirs[@]}" -o "$out/sweep_report" || report_rc=$?
if [ "$report_rc" -ne 0 ]; then
  echo "tp_sweep.sh: error: tools/sweep_report.py failed (exit $report_rc)" >&2
  exit 1
fi
if [ ${#skipped[@]} -gt 0 ]; then
  echo "tp_sweep.sh: skipped (not enough processes): ${skipped[*]}"
fi
if [ ${#invalid[@]} -gt 0 ]; then
  echo "tp_sweep.sh: not run (refused by the config): ${invalid[*]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "tp_sweep.sh: FAILED runs: ${failed[*]} (see their logs in $out)" >&2
  exit 1
fi
if [ "$ran" -eq 0 ]; then
  echo "tp_sweep.sh: error: no run was started (all skipped or refused by the config; see above)" >&2
  exit 1
fi
echo "tp_sweep.sh: all runs ok; report $out/sweep_report.md, $out/sweep_report.csv"
