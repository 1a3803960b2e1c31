#!/usr/bin/env bash
# Launch a GRPO run: one process per rank under torchrun.
#
#   bash launch/train_grpo.sh [CONFIG.yaml] [section.key=value ...]
#   bash launch/train_grpo.sh configs/tiny.yaml parallel.tp=2 precision.mode=bf16 run.steps=3
#
# Arguments go to `python -m megatron_jetrl.rl.train` verbatim (default config: configs/tiny.yaml).
#
# Two modes:
#   * not under torchrun (no RANK/LOCAL_RANK in the environment): asks the config module how many processes
#     the run needs (`python -m megatron_jetrl.rl.config ARGS --get parallel.world_size`, = tp*pp*dp) and
#     starts `torchrun --standalone --nproc-per-node=N` with this script as each rank's program;
#   * under torchrun (RANK set), e.g. `torchrun --no-python --nproc-per-node=2 launch/train_grpo.sh ARGS`:
#     runs the trainer for this rank.
# It exits with the trainer's exit code: torchrun itself reports any worker failure as 1, so each rank records
# its exit code in $JETRL_EXIT_DIR (when set) and the code of the first rank that failed is returned; the last line
# printed is that rank's one-line error (the trainer writes it to $JETRL_EXIT_DIR/rank<R>.msg), after torchrun's
# report. A config the machine or the run directory cannot run is refused before torchrun starts.
#
# Environment (all optional):
#   PYTHON               interpreter (default: <repo>/.venv/bin/python if present, else python3)
#   JETRL_TRAIN_MODULE   trainer module, or a .py file (default megatron_jetrl.rl.train)
#   JETRL_CONFIG_MODULE  module answering `ARGS --get parallel.world_size` (default megatron_jetrl.rl.config,
#                        or JETRL_TRAIN_MODULE itself when that is set to something else)
#   JETRL_NPROC          number of processes; skips asking the config module
#   JETRL_TORCHRUN_ARGS  torchrun arguments replacing "--standalone --nproc-per-node=N" (word-split)
#   OMP_NUM_THREADS      default: CPU cores / processes (at least 1), only when unset
#   OMP_WAIT_POLICY      default PASSIVE: idle OpenMP threads sleep instead of spinning. On a CPU shared with other
#                        work, spinning threads made a 2-thread matmul 10-20x slower than 1 thread (2-core CI box)
#   PYTHONUNBUFFERED     default 1 (rank logs appear as they are written)
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi  # `sh launch/train_grpo.sh`: this script needs bash
set -euo pipefail

# `python -m MODULE` or `python FILE.py`
module_cmd() {
  case $1 in
    *.py) printf '%s\n' "$1" ;;
    *) printf '%s\n' -m "$1" ;;
  esac
}

# "<code> <rank>" for a torchrun that exited with $2: the earliest non-zero code recorded by a rank in directory
# $1 (files rank<R>.rc holding "<code> <time ns>") and that rank; else "$2" alone (no rank recorded a failure).
first_failure() {
  local dir=$1 rc=$2 best="" best_t="" best_rank="" code t f
  if [ "$rc" -eq 0 ]; then
    echo 0
    return
  fi
  for f in "$dir"/rank*.rc; do
    [ -f "$f" ] || continue
    read -r code t <"$f" || continue
    [ "${code:-0}" != 0 ] || continue
    if [ -z "$best" ] || [ "$t" -lt "$best_t" ]; then
      best=$code
      best_t=$t
      best_rank=${f##*/rank}
      best_rank=${best_rank%.rc}
    fi
  done
  echo "${best:-$rc} $best_rank"
}

# The whole launcher is this function, called on the last line: bash parses it completely before running it,
# so editing or checking out this file while a run is live cannot change what the running launcher does.
main() {
  script=$(readlink -f "${BASH_SOURCE[0]}")
  repo=$(dirname "$(dirname "$script")")

  py=$(bash "$repo/launch/python.sh")
  { read -r train_module; read -r config_module; } < <(bash "$repo/launch/python.sh" modules)
  # The repository on the import path, so the modules resolve from any working directory (relative config and
  # out_dir paths stay relative to the caller's directory).
  case ":${PYTHONPATH:-}:" in
    *":$repo:"*) ;;
    *) export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
  export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

  # ---------------------------------------------------------------- rank mode (under torchrun)
  if [ -n "${RANK:-}" ] || [ -n "${LOCAL_RANK:-}" ]; then
    mapfile -t mod < <(module_cmd "$train_module")
    if [ -z "${JETRL_EXIT_DIR:-}" ]; then
      exec "$py" "${mod[@]}" "$@"
    fi
    # the trainer as a child that torchrun's SIGTERM (its stop for the survivors of a failed rank) reaches too: this
    # wrapper is torchrun's worker and passes it on, so no rank outlives the run
    rc=0
    "$py" "${mod[@]}" "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do
      rc=0
      wait "$child" || rc=$?
    done
    printf '%s %s\n' "$rc" "$(date +%s%N)" >"$JETRL_EXIT_DIR/rank${RANK:-$LOCAL_RANK}.rc" || true
    exit "$rc"
  fi

  # ---------------------------------------------------------------- launcher mode
  case ${1:-} in
    -h|--help)
      sed -n '2,/^if \[ -z "${BASH_VERSION/p' "$script" | sed '$d' | sed 's/^# \{0,1\}//'
      exit 0
      ;;
  esac

  shown_args=""
  if [ $# -gt 0 ]; then shown_args=$(printf ' %q' "$@"); fi
  if [ -z "${PYTHON:-}" ] && [ -z "${RANK:-}" ]; then  # the repository's .venv, completed where it is not
    mark=$(cat "$repo/tools/setup.sh" "$repo/requirements.txt" | sha256sum | cut -d' ' -f1)
    if [ ! -x "$repo/.venv/bin/python" ]; then
      echo "train_grpo.sh: first run: creating $repo/.venv (bash tools/setup.sh; about two minutes)" >&2
    elif [ "$(cat "$repo/.venv/.jetrl-setup" 2>/dev/null)" != "$mark" ]; then
      echo "train_grpo.sh: $repo/.venv is incomplete or older than requirements.txt (an interrupted first run?): completing it (bash tools/setup.sh)" >&2
    fi
    if [ "$(cat "$repo/.venv/.jetrl-setup" 2>/dev/null)" != "$mark" ]; then
      bash "$repo/tools/setup.sh" || { echo "train_grpo.sh: error: bash tools/setup.sh failed (its error is above); run it again once that is fixed" >&2; exit 2; }
    fi
    py=$repo/.venv/bin/python
  fi
  if ! command -v "$py" >/dev/null 2>&1; then
    echo "train_grpo.sh: error: python interpreter '$py' not found; set PYTHON=/path/to/python, or unset it to use $repo/.venv (made by bash tools/setup.sh)" >&2
    exit 2
  fi
  if ! "$py" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in ("torch", "yaml", "megatron.core")))' 2>/dev/null; then
    echo "train_grpo.sh: error: '$py' lacks the requirements (torch, pyyaml, megatron-core, ...): install them into it (pip install torch==2.13.0 -r requirements.txt on a CPU box, or the README's 'Running on GPUs'), or unset PYTHON to use $repo/.venv" >&2
    exit 2
  fi

  if [ -n "${JETRL_NPROC:-}" ]; then
    nproc_run=$JETRL_NPROC
    nproc_source=JETRL_NPROC
  else
    nproc_source="$config_module --get parallel.world_size"
    mapfile -t cmod < <(module_cmd "$config_module")
    get_rc=0
    get_err=$(mktemp "${TMPDIR:-/tmp}/jetrl-get.XXXXXX")
    nproc_run=$("$py" "${cmod[@]}" "$@" --get parallel.world_size 2>"$get_err") || get_rc=$?
    if [ "$get_rc" -eq 2 ]; then  # a config error: its own message (the key and the fix) is all there is to say
      cat "$get_err" >&2
      rm -f "$get_err"
      exit 2
    elif [ "$get_rc" -ne 0 ]; then  # the config module itself broke: what it printed, after what was asked of it
      echo "train_grpo.sh: error: '$py ${cmod[*]}$shown_args --get parallel.world_size' failed (exit $get_rc):" >&2
      cat "$get_err" >&2
      rm -f "$get_err"
      exit "$get_rc"
    fi
    cat "$get_err" >&2
    rm -f "$get_err"
    nproc_run=$(printf '%s' "$nproc_run" | tail -n 1 | tr -d '[:space:]')
  fi
  if ! [[ $nproc_run =~ ^[1-9][0-9]*$ ]]; then
    echo "train_grpo.sh: error: the world size must be a positive integer, got '$nproc_run' (from $nproc_source)" >&2
    exit 2
  fi

  if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)  # nproc obeys OMP_* otherwise
    threads=$((cores / nproc_run))
    export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
  fi

  if [ -n "${JETRL_TORCHRUN_ARGS:-}" ]; then
    read -r -a torchrun_args <<<"$JETRL_TORCHRUN_ARGS"
  else
    torchrun_args=(--standalone "--nproc-per-node=$nproc_run")
  fi

  JETRL_EXIT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/jetrl-exit.XXXXXX")
  export JETRL_EXIT_DIR
  trap 'rm -rf "$JETRL_EXIT_DIR"' EXIT
  echo "train_grpo.sh: $nproc_run process(es), OMP_NUM_THREADS=$OMP_NUM_THREADS OMP_WAIT_POLICY=$OMP_WAIT_POLICY, each: $py $(module_cmd "$train_module" | paste -sd' ')$shown_args" >&2
  # torchrun runs in its own session, in the background: a terminal's Ctrl-C reaches this script alone, which passes
  # each SIGINT/SIGUSR1 on to the ranks (their pids in $JETRL_EXIT_DIR), and a SIGTERM as SIGUSR1 (a rank's own
  # SIGTERM is torchrun's "stop now"): the first stops the run at the end of its step with a checkpoint, a second at
  # once (megatron_jetrl/rl/interrupt.py); the ranks then leave with exit 0, so torchrun says nothing, and this script
  # says where the run stopped and how to resume it. SIGHUP stops torchrun (and its ranks) outright.
  setsid "$py" -m torch.distributed.run "${torchrun_args[@]}" --no-python bash "$script" "$@" &
  torchrun_pid=$!
  interrupted=""
  forward() {  # SIGNAL [AS]: to every rank that has said its pid (before that: to torchrun, which stops them)
    interrupted=${interrupted:-$1}
    local f sent=""
    for f in "$JETRL_EXIT_DIR"/rank*.pid; do
      [ -f "$f" ] && kill "-${2:-$1}" "$(cat "$f")" 2>/dev/null && sent=1
    done
    [ -n "$sent" ] || kill -TERM "$torchrun_pid" 2>/dev/null || true
  }
  trap 'forward INT' INT
  trap 'forward TERM USR1' TERM
  trap 'forward USR1' USR1
  trap 'kill -TERM "$torchrun_pid" 2>/dev/null || true' HUP
  rc=0
  wait "$torchrun_pid" || rc=$?
  while kill -0 "$torchrun_pid" 2>/dev/null; do  # interrupted by a signal: wait for the ranks to stop
    rc=0
    wait "$torchrun_pid" || rc=$?
  done
  if [ -s "$JETRL_EXIT_DIR/interrupted" ]; then  # a signal stopped the run (this script's, or one sent to a rank)
    IFS=$'\t' read -r ranksig line <"$JETRL_EXIT_DIR/interrupted"
    sig=${interrupted:-${ranksig#SIG}}
    echo "train_grpo.sh: interrupted (SIG$sig): $line; resume: bash $(printf '%q' "$0")$shown_args" >&2
    return $((128 + $(kill -l "$sig")))
  fi
  read -r code rank < <(first_failure "$JETRL_EXIT_DIR" "$rc")
  if [ "$code" -ne 0 ]; then
    signal=""
    if [ "$code" -gt 128 ]; then signal=", SIG$(kill -l $((code - 128)) 2>/dev/null || echo $((code - 128)))"; fi
    # the last line the user sees, after torchrun's report: the failing rank's own one-line message
    # (rank<R>.msg, written by the trainer: `config error: ...` or the failure report), else another rank's
    if [ -n "$rank" ] && [ -s "$JETRL_EXIT_DIR/rank$rank.msg" ]; then
      why=": $(head -n 1 "$JETRL_EXIT_DIR/rank$rank.msg")"
    else
      why="; its error is above"
      for f in "$JETRL_EXIT_DIR"/rank*.msg; do
        if [ -s "$f" ]; then why="; $(head -n 1 "$f")"; break; fi
      done
    fi
    where=""  # the failing rank's last position, from its heartbeat (a killed rank says nothing itself)
    if [ -n "$rank" ] && [ -s "$JETRL_EXIT_DIR/rank$rank.where" ]; then where=" $(head -n 1 "$JETRL_EXIT_DIR/rank$rank.where")"; fi
    if [ -n "$rank" ]; then
      echo "train_grpo.sh: the run failed with exit code $code (torchrun: $rc): rank $rank failed first (exit code $code$signal)$where$why" >&2
    else
      echo "train_grpo.sh: the run failed with exit code $code (torchrun: $rc); no rank recorded an exit code (torchrun's report above says why)" >&2
    fi
  fi
  return "$code"
}

main "$@"; exit
