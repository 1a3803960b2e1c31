#!/usr/bin/env bash
# Create (or complete) the CPU environment in .venv: torch 2.13.0 CPU first (so nothing pulls a CUDA build),
# then requirements.txt. Idempotent; tools/test.sh calls it, and launch/train_grpo.sh whenever .venv lacks the mark of a
# finished setup (missing, or left half-built by an interrupted first run). The mark, .venv/.jetrl-setup, holds the
# hash of this script and requirements.txt, so a change to either completes the environment again.
#   bash tools/setup.sh [--help]
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
venv=${JETRL_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements.txt
cat tools/setup.sh requirements.txt | sha256sum | cut -d' ' -f1 >"$venv/.jetrl-setup"
