# session 28 call E (issue 14, no vLLM; H100 unless the tool gives an H200): the targets with today's code in one run:
# the Triton division's edge-case bytes; the four linears with TE 2.20.2 beside them and the plain layer
# (bench_fp8); megatron's layer at the presets' micro-batch (4 x 8192 tokens); the whole actor step with as many
# Qwen3-8B layers as fit; then this machine's DeepGEMM kernels for the next call.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s28e; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - $(date +%s) + T0 )); }
bash tools/gpu_fp8.sh setup > $W/setup.log 2>&1; grep -E "torch|DeepGEMM|TE|Transformer|megatron" $W/setup.log | head -6
source .kits/te/bin/env.sh 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader
(while true; do nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader >> $W/clocks.csv; sleep 1; done) >/dev/null 2>&1 & CLK=$!
el tests; timeout $(left 150) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "division_edges" -rf > $W/tests.log 2>&1
tail -1 $W/tests.log; grep -E "^FAILED|^E " $W/tests.log | head -6
el linear; timeout $(left 260) python3 -W ignore tools/bench_fp8.py --sections ceilings linear layer --json $W/linear.json > $W/linear.log 2>&1
grep -E "^\||target|decoder" $W/linear.log | head -24
el layer; timeout $(left 350) python3 -W ignore tools/bench_actor.py --layer --shapes 8192x4 --variants bf16 jetrl --profile --json $W/layer.json > $W/layer.log 2>&1
grep -vE "Warning|warn" $W/layer.log | tail -12
el step; timeout $(left 545) python3 -W ignore tools/bench_actor.py --json $W/step.json > $W/step.log 2>&1
grep -vE "Warning|warn" $W/step.log | tail -14
el jit; timeout $(left 575) bash tools/jit_cache.sh save $OUT > $W/jit.log 2>&1; tail -2 $W/jit.log
el done; kill $CLK
tar -czf $OUT/s28_E.tgz -C $W . 2>/dev/null
