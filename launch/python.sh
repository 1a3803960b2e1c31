#!/usr/bin/env bash
# What the launch scripts run.
#   bash launch/python.sh          the interpreter: $PYTHON if set, else the repository's .venv, else python3
#   bash launch/python.sh modules  two lines, TRAIN_MODULE and CONFIG_MODULE: $JETRL_TRAIN_MODULE (default megatron_jetrl.rl.train)
#                                  and the module that loads and checks its config: $JETRL_CONFIG_MODULE, else
#                                  megatron_jetrl.rl.config for the default trainer, else the trainer itself
case ${1:-} in -h|--help) sed -n '2,/^repo=/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${1:-}" = modules ]; then
  train=${JETRL_TRAIN_MODULE:-megatron_jetrl.rl.train}
  if [ -n "${JETRL_CONFIG_MODULE:-}" ]; then
    printf "%s\n" "$train" "$JETRL_CONFIG_MODULE"
  elif [ "$train" = megatron_jetrl.rl.train ]; then
    printf "%s\n" "$train" megatron_jetrl.rl.config
  else
    printf "%s\n" "$train" "$train"
  fi
elif [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
  echo "$repo/.venv/bin/python"
else
  echo python3
fi
