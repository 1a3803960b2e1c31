# session 22 call C: GPU tests of the trimmed FP8 linear; host A/B (HEAD a5631ef vs working tree); four linears A/B
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1
NEW=/tmp/dg:/tmp/mcore:$PWD; OLD=/tmp/dg:/tmp/mcore:$PWD/.calls/s22_old
el tests; PYTHONPATH=$NEW timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_fused.py -k "fp8_linear or deepgemm or gated or swiglu_backward or requantize or quantize_dual or quantize_1x128 or backends_match or local_layer" > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
for r in 1 2; do for code in old new; do
  if [ $code = old ]; then PP=$OLD; else PP=$NEW; fi
  echo -n "host $code $r "; PYTHONPATH=$PP timeout 60 python3 -W ignore .calls/s22_host.py default 2>&1 | tail -1
done; done
for code in old new old new; do
  if [ $code = old ]; then PP=$OLD; else PP=$NEW; fi
  el "linears $code"; PYTHONPATH=$PP timeout 100 python3 -W ignore tools/bench_fp8.py --sections linear --no-te-fused --json $OUT/lin_$code.json > $OUT/lin_$code.log 2>&1; grep -E "^\| (qkv|o |gate_up|down|\*\*)|^target" $OUT/lin_$code.log | sed "s/^/$code /"
  [ -f $OUT/lin_${code}_1.json ] || cp $OUT/lin_$code.json $OUT/lin_${code}_1.json
done
el done
