# session 25 call C: DeepGEMM's decode GEMMs with its SM budget swept (.calls/s25_dgsms.py), then megatron's layer
# at the presets' micro-batch with the kernel-time profile (where jetrl's fwd+bwd goes against bf16).
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25c; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - $(date +%s) + T0 )); }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; tail -1 $W/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
el dgsms; timeout $(left 330) python3 -W ignore .calls/s25_dgsms.py $W/dgsms.json > $W/dgsms.log 2>&1; grep -E "^copy|^M=" $W/dgsms.log
grep -c "GEMM type" $W/dgsms.log
el layer; timeout $(left 540) python3 -W ignore tools/bench_actor.py --layer --shapes 8192x4 --variants bf16 jetrl --profile bf16 jetrl --json $W/layer.json > $W/layer.log 2>&1
grep -vE "Warning|warn|Unknown MLP" $W/layer.log | tail -22
el jit; timeout $(left 575) bash tools/jit_cache.sh save $OUT > $W/jit.log 2>&1; tail -1 $W/jit.log
el done; tar -czf $OUT/s25_C.tgz -C $W . 2>/dev/null
