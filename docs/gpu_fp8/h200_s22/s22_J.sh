# session 22 call J: configs/gpu_8b_shapes.yaml as shipped now (micro-batch 64), jetrl and bf16, with the synced phase times
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16" RUN_TIMEOUT=160 timeout 330 bash tools/gpu_grpo_run.sh run.steps=4 > $OUT/grpo.log 2>&1
grep -E "^\| (jetrl|bf16)|bf16 time" $OUT/table.md | head -4
echo "[t+$(( $(date +%s) - T0 ))s] done"
