#!/usr/bin/env bash
# Prints the interpreter the launch scripts use: $PYTHON if set, else the repository's .venv, else python3.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
  echo "$repo/.venv/bin/python"
else
  echo python3
fi
