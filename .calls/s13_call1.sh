#!/usr/bin/env bash
# session 13, call 1 (H200): GPU tests of the fused logprobs / fused Adam, then the actor step, shipped vs session-12 state
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL_TIMEOUT=90 bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -8 $OUT/setup.log
export PYTHONPATH=/tmp/dg:/tmp/mcore:. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused.py tests/gpu/test_distributed_optimizer_gpu.py 2>&1 \
  | tee $OUT/tests.log | grep -v -E "Warning|warn" | tail -15
timeout ${STEP_T:-330} python3 tools/bench_actor.py --layers ${LAYERS:-20} --step-profile --json $OUT/step.json \
  --modes bf16 jetrl bf16+model.fused=false+optim.fused=false jetrl+model.fused=false+optim.fused=false 2>&1 \
  | tee $OUT/step.log | grep -E "^\||^target|layers|^top|probe|Error|error" | cut -c1-400
