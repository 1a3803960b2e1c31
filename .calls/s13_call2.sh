#!/usr/bin/env bash
# session 13, call 2 (H200): linears (with TE) and the megatron layer with host issue time, shipped defaults
set -uo pipefail
cd "$(dirname "$0")/.."
TOTAL_TIMEOUT=150 bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -6 $OUT/setup.log
export PYTHONUNBUFFERED=1
( source .kits/te/bin/env.sh; export PYTHONPATH=/tmp/dg:/tmp/mcore:.:${PYTHONPATH:-}
  timeout 200 python3 tools/bench_fp8.py --sections ceilings linear profile --json $OUT/fp8.json > $OUT/fp8.log 2>&1
  grep -E "^\||^target|^ceiling|^profile|^gap|^timeline|idle|host" $OUT/fp8.log | grep -v "^| | " | tail -45 )
export PYTHONPATH=/tmp/dg:/tmp/mcore:.
timeout 170 python3 tools/bench_actor.py --layer --shapes 8192x1 4096x2 4096x1 --variants bf16 jetrl --profile bf16 jetrl \
  --json $OUT/layer.json > $OUT/layer.log 2>&1
grep -E "^\||^top" $OUT/layer.log | cut -c1-700
