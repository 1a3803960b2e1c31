# session 22 call H: configs/gpu_8b_shapes.yaml (8 Qwen3-8B layers) at micro-batch 128 and 64 (shipped: 16), jetrl and bf16, native engine
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
for mb in 128 64; do
  el "mb $mb"; CONFIG=configs/gpu_8b_shapes.yaml OUT=$OUT/mb$mb MODES="jetrl bf16" RUN_TIMEOUT=150 SUFFIX=_mb$mb timeout $(( 575 - $(date +%s) + T0 )) bash tools/gpu_grpo_run.sh run.steps=4 grpo.micro_batch_size=$mb > $OUT/grpo_mb$mb.log 2>&1
  grep -E "^\| (jetrl|bf16)|bf16 time" $OUT/mb$mb/table.md 2>/dev/null | head -4
done
el done
