# session 29 call A (issue 14, no vLLM): the WGrad GEMM probe (.calls/s29_wgrad.py) after the DeepGEMM kit; the
# Triton GEMM's new accumulate path through the GPU GEMM tests.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29a; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|torch" $W/setup.log | head -3
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader
(while true; do nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader >> $W/clocks.csv; sleep 1; done) >/dev/null 2>&1 & CLK=$!
el probe; DG_PRINT_CONFIGS=1 OUT=$W timeout 330 python3 -W ignore .calls/s29_wgrad.py > $W/wgrad.log 2>&1
grep -vE "GemmDesc|^$" $W/wgrad.log | tail -75
el tests; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "gemm or accumulates" -rf > $W/tests.log 2>&1; tail -2 $W/tests.log
el done; kill $CLK
tar -czf $OUT/s29_A.tgz -C $W . 2>/dev/null
