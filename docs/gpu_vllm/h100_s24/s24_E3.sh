# session 24 call E3 (after the kit's two calls): the fused activation quantization on the GPU (the norm kernel's
# 25 cases; test_vllm.py with the engine fusing), then decode at Qwen3-8B shapes, batches 64/128/256 with the one-step
# profile at 128 (GPU idle by gap length): jetrl:fused-quant, bf16, jetrl shipped (unfused)
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $W/unpack.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; JETRL_VLLM_TEST_ENGINE='{"fused_quant": true}' timeout 230 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused.py \
  tests/gpu/test_vllm.py -k "norm_with_fused or test_vllm" -rf > $W/tests_fused.log 2>&1; rc=$?
grep -E "passed|failed|Error|numerics:" $W/tests_fused.log | tail -6
[ $rc = 0 ] && touch $W/fused_ok && echo "fused tests rc 0"
el bench; OUT=$W/bench RUNS="jetrl:fused-quant bf16 jetrl" BENCH_ARGS="--batches 64 128 256 --reps 2 --sync-reps 2 --profile-batch 128" \
  timeout $(( 585 - $(date +%s) + T0 )) bash tools/gpu_vllm.sh bench > $W/bench.log 2>&1
grep -E "^\[" $W/bench.log | grep -v INFO | grep -E "start|batch|wall|idle|act quant|norm |SiLU|GEMM FP8"
el done
tar -czf $OUT/s24_E3.tgz -C $W tests_fused.log bench.log bench 2>/dev/null; ls -la $OUT
