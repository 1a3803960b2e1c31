# session 22 call D: GPU tests of the trimmed FP8 linear (all of call C's selection); GRPO gpu_1p5b as shipped (mb128), jetrl + bf16
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
el tests; timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_fused.py -k "fp8_linear or deepgemm or gated or swiglu_backward or requantize or quantize_dual or quantize_1x128 or backends_match or local_layer" -rf > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
el grpo; MODES="jetrl bf16" RUN_TIMEOUT=200 timeout 330 bash tools/gpu_grpo_run.sh run.steps=4 > $OUT/grpo.log 2>&1
tail -6 $OUT/grpo.log
el done
