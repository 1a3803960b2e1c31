# session 23 call A: GPU tests (gated backward, FP8 linear); GRPO with synced phases: configs/gpu_8b_shapes.yaml (shipped,
# micro-batch 64) and configs/gpu_1p5b.yaml (native engine), jetrl and bf16, 4 steps each
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el tests; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "gated or fp8_linear_on_cuda or default_fp8_linear" -rf > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
el grpo8b; CONFIG=configs/gpu_8b_shapes.yaml OUT=$OUT/g8b MODES="jetrl bf16" RUN_TIMEOUT=150 timeout 280 bash tools/gpu_grpo_run.sh run.steps=4 > $OUT/grpo8b.log 2>&1
grep -E "^\| (jetrl|bf16)|bf16 time" $OUT/g8b/table.md | head -4
el grpo1p5b; OUT=$OUT/g15 MODES="jetrl bf16" RUN_TIMEOUT=190 timeout $(( 585 - $(date +%s) + T0 )) bash tools/gpu_grpo_run.sh run.steps=4 > $OUT/grpo15.log 2>&1
grep -E "^\| (jetrl|bf16)|bf16 time" $OUT/g15/table.md | head -4
el done
