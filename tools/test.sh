#!/usr/bin/env bash
# Set up a CPU environment (idempotent) and run the test suite: bash tools/test.sh [pytest args...]
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
cd "$(dirname "$0")/.."
venv=${JETRL_VENV:-.venv}
bash tools/setup.sh                     # .venv: torch 2.13.0 CPU first, then requirements.txt
# The suite writes ~3 GiB here (.venv, wheels) and several GiB of runs and checkpoints under the temp directory: on a
# fuller disk its checkpoint tests fail with "No space left on device", so say it before they run.
for dir in . "${TMPDIR:-/tmp}"; do
  free_gib=$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gib" -lt 10 ]; then
    echo "tools/test.sh: only $free_gib GiB free on the disk of $dir; the tests need about 10 GiB: free some space" \
      "(old clones, /tmp/pytest-of-$(id -un)) or point TMPDIR at a larger disk" >&2
  fi
done
# Transformer Engine's pure-Python wheel: its recipe module is read by tests/unit/test_flow.py
# (the full TE needs CUDA and cannot be installed on CPU machines).
export JETRL_WHEEL_CACHE=${JETRL_WHEEL_CACHE:-.cache/wheels}
if ! ls "$JETRL_WHEEL_CACHE"/transformer_engine-2.20.2-*.whl >/dev/null 2>&1; then
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps transformer-engine==2.20.2 -d "$JETRL_WHEEL_CACHE"
fi
# The GPU machine's Triton (its wheel carries ptxas): tests/unit/test_triton_kernels_source.py compiles the fused
# quantization kernels for sm_90 with it, unpacked beside the cache (never installed into .venv: torch stays CPU).
if ! ls "$JETRL_WHEEL_CACHE"/triton-3.6.0-*.whl >/dev/null 2>&1; then  # 188 MB: a failed download skips that test, said
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps triton==3.6.0 -d "$JETRL_WHEEL_CACHE" \
    || echo "tools/test.sh: could not download triton==3.6.0; tests/unit/test_triton_kernels_source.py will be skipped" >&2
fi
# Lint and format first (pyproject.toml [tool.ruff]; `ruff format .` fixes the format, `ruff check --fix .` most lint).
"$venv/bin/python" -m ruff check --quiet . || { echo "tools/test.sh: ruff check found the problems above" >&2; exit 1; }
"$venv/bin/python" -m ruff format --check --quiet . || { echo "tools/test.sh: run 'ruff format .' (the files above)" >&2; exit 1; }
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
