# session 25 call G3 (after the kit's two calls): GRPO with vLLM at Qwen3-8B layer shapes (configs/gpu_8b_shapes.yaml:
# 8 layers, 3.0B parameters) on one H100, jetrl then bf16, 4 steps, decode CUDA graphs (enforce_eager=false).
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25g; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el grpo; OUT=$W CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16" RUN_TIMEOUT=270 \
  GRPO_ARGS="run.steps=4 rollout.enforce_eager=false" timeout 570 bash tools/gpu_vllm.sh grpo > $W/grpo.log 2>&1
tail -30 $W/grpo.log | grep -vE "INFO|WARNING" | tail -22
el done; tar -czf $OUT/s25_G3.tgz -C $W . 2>/dev/null
