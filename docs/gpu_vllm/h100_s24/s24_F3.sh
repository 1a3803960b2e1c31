# session 24 call F3 (after the kit's two calls): tests/gpu/test_vllm_grpo.py on the new defaults (fused activation
# quantization) with the engine's sleep measured by its allocator (ColocatedPool.wake_bytes = VllmEngine.mapped_bytes)
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $W/unpack.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm_grpo.py -rf > $W/tests_grpo.log 2>&1
grep -E "passed|failed|Error|freed|numerics" $W/tests_grpo.log | tail -8
el done
cp $W/tests_grpo.log $OUT/
