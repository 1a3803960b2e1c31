# session 24 call H: the training-side GPU tests G's 230 s did not reach, in priority order (each its own limit)
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24h; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
t() { local lim=$(( $1 < 200 - $(date +%s) + T0 ? $1 : 200 - $(date +%s) + T0 )); shift; [ $lim -gt 5 ] || { echo "skipped: $*"; return; }
      el "$*"; timeout $lim python3 -m pytest -q -p no:cacheprovider "$@" -rf >> $W/tests.log 2>&1; tail -1 $W/tests.log; grep -E "^FAILED" $W/tests.log | tail -4; }
t 90 tests/gpu/test_kernels.py -k "swiglu_fused_quantization or also_writes"
t 60 tests/gpu/test_fused.py -k "rms_norm or local_layer"
t 80 tests/gpu/test_kernels.py -k "fp8_linear_on_cuda or default_fp8_linear"
el done; cp $W/tests.log $OUT/
