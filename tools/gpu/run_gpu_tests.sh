#!/usr/bin/env bash
# Run every GPU test in one go on a CUDA machine (the H200): bash tools/gpu/run_gpu_tests.sh [pytest args...]
# (paths under tests/ in the args run those tests only, e.g. tests/gpu/test_kernels.py -k cuda_tile)
# From the repository root, with the machine's own python3 (torch + Triton); no install needed.
# Exit status: pytest's; 2 when this machine has no CUDA GPU (or python3 lacks torch/Triton), said in one line.
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run
cd "$(dirname "$0")/../.."
python3 - <<'PY' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"tools/gpu/run_gpu_tests.sh needs a CUDA GPU and python3 with torch + Triton; this python3 ({sys.executable}) "
             f"has no {' and no '.join(missing)}: run it on the GPU machine (CPU tests: bash tools/test.sh)")
import torch, triton
if not torch.cuda.is_available():
    sys.exit("tools/gpu/run_gpu_tests.sh needs a CUDA GPU and none is visible here (check CUDA_VISIBLE_DEVICES and the driver); "
             "CPU tests: bash tools/test.sh")
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, cc {torch.cuda.get_device_capability()}")
PY
# test paths given (tests/gpu/test_kernels.py, a ::node id) replace the default tests/gpu; options alone keep it
where=tests/gpu
for arg in "$@"; do case $arg in tests/*) where= ;; esac; done
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} exec python3 -m pytest -q -p no:cacheprovider -m gpu $where "$@"
