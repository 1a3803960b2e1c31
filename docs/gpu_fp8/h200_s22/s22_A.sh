# session 22 call A: host diag of the FP8 linear backward; GRPO gpu_1p5b at micro-batch 128 (jetrl, bf16)
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; nproc; lscpu | grep -E "Model name|MHz" | head -3
el diag; timeout 150 python3 -W ignore .calls/s22_diag.py > $OUT/diag.log 2>&1; grep -E "^round" $OUT/diag.log
el grpo; MODES="jetrl bf16" RUN_TIMEOUT=200 SUFFIX=_mb128 timeout 420 bash tools/gpu_grpo_run.sh run.steps=4 grpo.micro_batch_size=128 > $OUT/grpo.log 2>&1
tail -8 $OUT/grpo.log
el done
