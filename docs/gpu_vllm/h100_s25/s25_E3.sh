# session 25 call E3 (after the kit's two calls): vLLM with the Triton quantizers' new division. The SiLU-and-mul
# quantization of vLLM's FP8 MLPs runs the Triton 1x128 SwiGLU kernel (now one reciprocal + Markstein per group):
# test_vllm.py with the shipped engine (fusion on: its start-up probe compares the fused kernels' bytes), the fused
# norm's cases, then this machine's DeepGEMM kernels.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25e; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; OUT=$W PYTEST_K="norm_with_fused or test_vllm" TESTS="tests/gpu/test_fused.py tests/gpu/test_vllm.py" \
  timeout 420 bash tools/gpu_vllm.sh tests > $W/tests.log 2>&1
grep -E "passed|failed|numerics|probe" $W/tests.log | grep -v INFO | tail -8
el jit; OUT=$OUT timeout 60 bash tools/gpu_vllm.sh jit-save > $W/jit.log 2>&1; tail -2 $W/jit.log
el done; tar -czf $OUT/s25_E3.tgz -C $W . 2>/dev/null
