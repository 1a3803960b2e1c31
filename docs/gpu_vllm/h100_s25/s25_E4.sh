# session 25 call E4 (warm machine after E3): decode at Qwen3-8B shapes, batch 128 with the one-step profile, jetrl
# (shipped: the SiLU quantization now divides through one reciprocal per group) and bf16, in one call.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25e4; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el bench; OUT=$W/bench RUNS="jetrl bf16" BENCH_ARGS="--batches 64 128 256 --reps 2 --sync-reps 2 --profile-batch 128" \
  timeout 570 bash tools/gpu_vllm.sh bench > $W/bench.log 2>&1
grep -E "^\[" $W/bench.log | grep -v INFO | grep -E "start|batch|wall|idle|act quant|norm |SiLU|GEMM FP8" | head -30
el done; tar -czf $OUT/s25_E4.tgz -C $W bench.log bench 2>/dev/null
