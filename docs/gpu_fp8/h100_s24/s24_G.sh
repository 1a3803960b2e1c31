# session 24 call G (issue 14, no vLLM): the training-side FP8 kernels on the GPU after session 23's refactor
# (fp8.kernels.quant_math shared with the fused RMSNorm, quantize_1x128's PRODUCT store, _rms_fwd's QUANT constexpr):
# quantizer bytes against the reference, SwiGLU-fused quantizer, the FP8 linear, fused glue; then the quantizers'
# and the four linears' speed (bench_fp8 quant linear)
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24g; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "torch|deep_gemm|megatron" $W/setup.log | head -4
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
el tests; timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_fused.py tests/gpu/test_triton_launch.py \
  -k "reference_quantizer or quantize_1x128 or dual or requantize or swiglu or 128x128 or non_finite or fp8_linear_on_cuda or default_fp8_linear or gated or test_fused or launch" \
  -rf > $W/tests.log 2>&1; tail -1 $W/tests.log; grep -E "^FAILED" $W/tests.log | head -8
el bench; timeout $(( 430 - $(date +%s) + T0 )) python3 -W ignore tools/bench_fp8.py --sections ceilings quant linear --json $W/bench_fp8.json > $W/bench_fp8.log 2>&1
grep -E "^\||target|ceiling" $W/bench_fp8.log | head -40
el done
tar -czf $OUT/s24_G.tgz -C $W . 2>/dev/null
