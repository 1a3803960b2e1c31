#!/usr/bin/env bash
# session 28 call F (the vLLM kit's second call, meant for an H200): unpack kit-2, then vLLM jetrl at the issue's
# FACTS setting (prompt 512, 1024 new tokens), batches 128 and 256, decode profiles at the run's mean context.
cd "$(dirname "$0")/.." && t0=$(date +%s); DEV=${OUT:-/tmp/out}; V=/tmp/v; mkdir -p $V/h1
bash .kits/vllm/unpack.sh 2>&1 | tail -1
echo "unpacked at $(( $(date +%s) - t0 )) s; $(nvidia-smi --query-gpu=name,power.limit --format=csv,noheader)"
OUT=$V/h1 RUNS=${RUNS:-jetrl} BENCH_ARGS="--prompt 512 --new 1024 --batches 128 256 --reps 1 --sync-reps 2 --kv-gb 60 --profile-batch 128 256" \
  timeout 500 bash tools/gpu_vllm.sh bench
[ "${RUNS:-jetrl}" = bf16 ] && OUT=$V/h1 bash tools/gpu_vllm.sh report 2>&1 | grep -v '^== stage'
echo "done at $(( $(date +%s) - t0 )) s"
tar -czf $DEV/call_${RUNS:-jetrl}.tgz -C $V h1
