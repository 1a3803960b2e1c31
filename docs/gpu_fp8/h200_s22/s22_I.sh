# session 22 call I: configs/gpu_8b_shapes.yaml as shipped before this session (micro-batch 16), jetrl and bf16: call H's baseline
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16" RUN_TIMEOUT=170 SUFFIX=_mb16 timeout 400 bash tools/gpu_grpo_run.sh run.steps=4 grpo.micro_batch_size=16 > $OUT/grpo_mb16.log 2>&1
grep -E "^\| (jetrl|bf16)|bf16 time" $OUT/table.md | head -4
echo "[t+$(( $(date +%s) - T0 ))s] done"
