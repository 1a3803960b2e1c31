# session 29 call B (issue 14, no vLLM): bench_fp8's quantizers against the copy rate on this card (not measured on
# an H200 since session 22), the four linears with TE beside them and the new floor line, the plain layer and the
# linear profile; GPU clocks and power each second.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s29b; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "DeepGEMM|TE|torch" $W/setup.log | head -4
source .kits/te/bin/env.sh 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader
(while true; do nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader >> $W/clocks.csv; sleep 1; done) >/dev/null 2>&1 & CLK=$!
el bench; timeout $(( 540 - $(date +%s) + T0 )) python3 -W ignore tools/bench_fp8.py --sections ceilings quant linear layer profile --json $W/bench_fp8.json > $W/bench_fp8.log 2>&1
grep -E "^\||target|floor|ceiling|decoder|gap|% of copy" $W/bench_fp8.log | grep -v "^|---" | tail -60
el done; kill $CLK
tar -czf $OUT/s29_B.tgz -C $W . 2>/dev/null
