# session 22 call E3 (after the kit's two calls): GRPO with vLLM at the shipped gpu_1p5b preset (micro-batch 128), jetrl and bf16
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
bash .kits/vllm/unpack.sh --need-complete > $OUT/unpack.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $OUT/unpack.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MODES="jetrl bf16" RUN_TIMEOUT=265 GRPO_ARGS="run.steps=4" timeout 560 bash tools/gpu_vllm.sh grpo > $OUT/grpo_vllm.log 2>&1
tail -12 $OUT/grpo_vllm.log
echo "[t+$(( $(date +%s) - T0 ))s] done"
