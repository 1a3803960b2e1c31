# session 22 call F: host A/B with the new tool (tools/bench_host.py --against a5631ef's tree); issue 14 benches as shipped (TE in the table)
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
TOTAL_TIMEOUT=200 bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -4 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
[ -f .kits/te/bin/env.sh ] && [ -d /tmp/te-site ] && source .kits/te/bin/env.sh
el host; timeout 150 python3 -W ignore tools/bench_host.py --against .calls/s22_old --rounds 2 > $OUT/host_ab.log 2>&1; cat $OUT/host_ab.log | tail -6
el bench; TOTAL_TIMEOUT=$(( 585 - $(date +%s) + T0 )) BENCH_FP8_TIMEOUT=240 FP8_ARGS="--sections ceilings quant linear layer" ACTOR_ARGS="--layers 22 --modes bf16 jetrl" bash tools/gpu_fp8.sh bench > $OUT/bench.log 2>&1; grep -E "^target|^\| \*\*all|^\| (qkv|o |gate_up|down) |speedup|x1\.[0-9]|step .* ms" $OUT/bench.log | head -30
el done
