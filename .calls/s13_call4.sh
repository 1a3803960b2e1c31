#!/usr/bin/env bash
# session 13, call 4 (H200): Triton RMSNorm/RoPE: GPU tests, layer (host time), step at 20 layers
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL_TIMEOUT=90 bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -3 $OUT/setup.log
export PYTHONPATH=/tmp/dg:/tmp/mcore:. PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused.py 2>&1 | tee $OUT/tests.log | grep -E "passed|failed|Error|assert|^E " | head -30
timeout 120 python3 tools/bench_actor.py --layer --shapes 8192x1 4096x1 --variants bf16 jetrl --profile bf16 jetrl \
  --json $OUT/layer.json > $OUT/layer.log 2>&1
grep -E "^\|" $OUT/layer.log | cut -c1-400
timeout ${STEP_T:-200} python3 tools/bench_actor.py --layers 20 --step-profile --json $OUT/step.json --modes bf16 jetrl 2>&1 \
  | tee $OUT/step.log | grep -E "^\||^target|Error|error" | cut -c1-400
