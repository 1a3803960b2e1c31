# session 23 call E5 (after the kit's two calls): test_vllm.py (its engine runs the fused activation quantization), then
# decode at Qwen3-8B shapes, batch 128 with the one-step profile: jetrl shipped (fused), jetrl:unfused-quant, bf16
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > /tmp/unpack.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 /tmp/unpack.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
el tests; timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm.py -rf > $OUT/tests.log 2>&1; grep -E "passed|failed|Error" $OUT/tests.log | tail -4
el bench; OUT=$OUT RUNS="jetrl jetrl:unfused-quant bf16" BENCH_ARGS="--batches 128 --reps 2 --sync-reps 2 --profile-batch 128" \
  timeout $(( 560 - $(date +%s) + T0 )) bash tools/gpu_vllm.sh bench > $OUT/bench.log 2>&1
grep -E "^\[" $OUT/bench.log | grep -v INFO | grep -E "start|batch 128|wall|act quant|norm |SiLU|GEMM FP8" | tail -20
rm -f $OUT/bench_*.log
el done
