#!/usr/bin/env bash
# Create (or complete) the CPU environment in .venv: torch 2.13.0 CPU first (so nothing pulls a CUDA build),
# then requirements.txt. Idempotent; tools/test.sh and launch/train_grpo.sh call it when .venv is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${JETRL_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements.txt
