# session 29 call C (issue 14): the GPU kernel tests on today's tree (the Triton GEMM's accumulating store, every
# quantizer and GEMM backend, the FP8 linear's shipped defaults) on an H200.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29c; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|torch" $W/setup.log | head -3
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
el tests; timeout 480 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_triton_launch.py -rfs > $W/tests.log 2>&1
tail -15 $W/tests.log
el done
tar -czf $OUT/s29_C.tgz -C $W . 2>/dev/null
