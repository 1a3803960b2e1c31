#!/usr/bin/env bash
# session 26 call B (no vLLM): SwiGLU-gradient divisions through RN(1/e) + Markstein; bytes, kernel timing, layer A/B
cd "$(dirname "$0")/.." && nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash tools/gpu_fp8.sh setup 2>&1 | tail -2
export PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/gpu/test_kernels.py -k "every_bf16_gate or fused_swiglu or tile_division or swiglu_backward_kernel" 2>&1 | tail -4
timeout 100 python3 .calls/s26_swiglu.py 2>&1 | tee $OUT/swiglu.log
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 > $OUT/clocks.csv &
SMI=$!
for order in "bf16 jetrl/swiglu-split jetrl/swiglu-half3 jetrl/swiglu-half" "jetrl/swiglu-half3 jetrl/swiglu-split bf16"; do
  timeout 200 python3 tools/bench_actor.py --layer --shapes 8192x4 --variants $order --profile > $OUT/layer_$(echo $order | tr ' /' '_-').log 2>&1; echo "layer rc $?"
  grep -E "^\| 32768|^\| bf16|^\| jetrl" $OUT/layer_$(echo $order | tr ' /' '_-').log
done
kill $SMI
bash tools/jit_cache.sh save $OUT 2>&1 | tail -1
