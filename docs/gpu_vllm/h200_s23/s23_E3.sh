# session 23 call E3 (after the kit's two calls): GPU tests of the fused activation quantization (kernels, then the vLLM
# engine: test_vllm.py, whose engine runs it by default) and decode at Qwen3-8B shapes: jetrl shipped (fused),
# jetrl:unfused-quant (as before), bf16; batch 128, with the one-step profile
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s23; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $W/unpack.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused.py tests/gpu/test_kernels.py tests/gpu/test_vllm.py \
  -k "norm_with_fused or also_writes_the_product or test_vllm" -rf > $W/tests.log 2>&1; grep -E "passed|failed|Error|numerics:" $W/tests.log | tail -6
el bench; OUT=$W/bench RUNS="jetrl jetrl:unfused-quant bf16" BENCH_ARGS="--batches 128 --reps 2 --sync-reps 2 --profile-batch 128" \
  timeout $(( 585 - $(date +%s) + T0 )) bash tools/gpu_vllm.sh bench > $W/bench.log 2>&1
grep -E "^\[" $W/bench.log | grep -v INFO | tail -24
el done
tar -czf $OUT/s23_E3.tgz -C $W tests.log bench.log bench 2>/dev/null; ls -la $OUT
