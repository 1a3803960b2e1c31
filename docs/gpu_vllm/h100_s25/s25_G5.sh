# session 25 call G5: vLLM decode at the GRPO preset's setting (configs/gpu_8b_shapes.yaml: 8 Qwen3-8B layers, batch
# 128, ~24-token prompts, 64 new tokens), jetrl and bf16, with the one-step profile: is FP8 decode itself slower
# there (G4: jetrl rollout 0.50 s against bf16's 0.36 s a step), or is it the GRPO loop around it?
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25g5; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el bench; OUT=$W/bench RUNS="jetrl bf16" BENCH_ARGS="--layers 8 --prompt 24 --new 64 --batches 128 --reps 3 --sync-reps 2 --kv-gb 8 --profile-batch 128" \
  timeout 560 bash tools/gpu_vllm.sh bench > $W/bench.log 2>&1; echo "rc $?"
grep -E "^\[" $W/bench.log | grep -v INFO | head -40
tail -5 $W/bench.log | grep -v INFO
el done; tar -czf $OUT/s25_G5.tgz -C $W bench.log bench 2>/dev/null
