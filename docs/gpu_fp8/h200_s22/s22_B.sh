# session 22 call B: host A/B (HEAD vs working tree) x GC variants; torch.profiler CPU table; FP8 linear GPU tests
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1
lscpu | grep -E "Model name" | head -1
for r in 1 2; do for v in default freeze; do for code in old new; do
  if [ $code = old ]; then PP=/tmp/dg:/tmp/mcore:$PWD/.calls/s22_old; else PP=/tmp/dg:/tmp/mcore:$PWD; fi
  echo -n "$code $r "; PYTHONPATH=$PP timeout 60 python3 -W ignore .calls/s22_host.py $v 2>&1 | tail -1
done; done; done
el profile; PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD timeout 60 python3 -W ignore .calls/s22_host.py default --profile > $OUT/profile.log 2>&1; head -45 $OUT/profile.log
el tests; PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "linear or gemm or wgrad or deepgemm" -x 2>&1 | tail -4
el done
