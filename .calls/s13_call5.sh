#!/usr/bin/env bash
# session 13, call 5 (H200): host trims; FP8 GPU tests subset, layer, step at 20 layers and at as many as fit
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL_TIMEOUT=90 bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log
export PYTHONPATH=/tmp/dg:/tmp/mcore:. PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_kernels.py -k "deepgemm or default or never_syncs or swiglu" 2>&1 \
  | tee $OUT/tests.log | grep -E "passed|failed|^E " | head -20
timeout 90 python3 tools/bench_actor.py --layer --shapes 8192x1 4096x1 --variants bf16 jetrl --profile bf16 jetrl \
  --json $OUT/layer.json > $OUT/layer.log 2>&1
grep -E "^\|" $OUT/layer.log | cut -c1-400
timeout ${STEP_T:-330} python3 tools/bench_actor.py --layers 20 auto --mem-gib 140 --step-profile --json $OUT/step.json --modes bf16 jetrl 2>&1 \
  | tee $OUT/step.log | grep -E "^\||^target|probe|extrapol|  (bf16|jetrl) |Error|error" | cut -c1-300
