# session 24 call E5 (right after E4, same warm machine): GRPO with vLLM, configs/gpu_1p5b.yaml, jetrl then bf16,
# 4 steps (full decode CUDA graphs, the trainer's glue); the fused activation quantization on if E3's tests passed
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s24; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack5.log 2>&1 || { echo "kit incomplete (machine released?)"; tail -3 $W/unpack5.log; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
FUSED=${FUSED:-false}; [ -f $W/fused_ok ] && FUSED=true; echo "rollout.vllm_fused_quant=$FUSED"
el grpo jetrl; OUT=$W/grpo_jetrl MODES=jetrl RUN_TIMEOUT=$(( 585 - 130 - $(date +%s) + T0 )) GRPO_ARGS="run.steps=4 rollout.vllm_fused_quant=$FUSED" \
  bash tools/gpu_vllm.sh grpo > $W/grpo_jetrl.log 2>&1; tail -12 $W/grpo_jetrl.log
el grpo bf16; OUT=$W/grpo_bf16 MODES=bf16 RUN_TIMEOUT=$(( 585 - $(date +%s) + T0 )) GRPO_ARGS="run.steps=4" PORT_BASE=29640 \
  bash tools/gpu_vllm.sh grpo > $W/grpo_bf16.log 2>&1; tail -6 $W/grpo_bf16.log
el done
tar -czf $OUT/s24_E5.tgz -C $W grpo_jetrl.log grpo_bf16.log grpo_jetrl grpo_bf16 2>/dev/null; ls -la $OUT
