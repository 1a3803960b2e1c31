#!/usr/bin/env bash
# Run every GPU test in one go on a CUDA machine (the H200): bash tools/run_gpu_tests.sh [pytest args...]
# From the repository root, with the machine's own python3 (torch + Triton); no install needed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "tools/run_gpu_tests.sh needs a CUDA GPU"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, cc {torch.cuda.get_device_capability()}")
PY
PYTHONPATH=. exec python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu "$@"
