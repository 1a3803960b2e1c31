#!/usr/bin/env bash
# session 26 call A (no vLLM): the per-tile SwiGLU-backward quantizers: tests, kernel timing, megatron layer
cd "$(dirname "$0")/.." && nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash tools/gpu_fp8.sh setup 2>&1 | tail -4
export PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "fused_swiglu or swiglu_backward_kernel" 2>&1 | tail -4
timeout 120 python3 .calls/s26_swiglu.py 2>&1 | tee $OUT/swiglu.log
timeout 240 python3 tools/bench_actor.py --layer --shapes 8192x4 --variants bf16 jetrl/swiglu-split jetrl/swiglu-half jetrl/swiglu-half3 jetrl/swiglu-fused --profile bf16 jetrl/swiglu-split jetrl/swiglu-half jetrl/swiglu-half3 --json $OUT/layer.json > $OUT/layer.log 2>&1; echo "layer rc $?"
tail -40 $OUT/layer.log
bash tools/jit_cache.sh save $OUT 2>&1 | tail -1
