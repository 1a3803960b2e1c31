#!/usr/bin/env bash
# session 28 call B (the vLLM kit's second call): unpack kit-2, then vLLM jetrl at the issue's FACTS setting
# (prompt 512, 1024 new tokens), batches 128 and 192 (256 does not fit an 80 GB card in BF16 at this length),
# with a decode profile at each batch at the run's mean context (the FP8 ceiling needs it).
cd "$(dirname "$0")/.." && t0=$(date +%s); DEV=${OUT:-/tmp/out}; V=/tmp/v; mkdir -p $V/s1 $V/s2
bash .kits/vllm/unpack.sh 2>&1 | tail -1
echo "unpacked at $(( $(date +%s) - t0 )) s; $(nvidia-smi --query-gpu=name,power.limit --format=csv,noheader)"
OUT=$V/s1 RUNS=jetrl BENCH_ARGS="--prompt 512 --new 1024 --batches 128 192 --reps 1 --sync-reps 2 --kv-gb 46 --profile-batch 128 192" \
  timeout 480 bash tools/gpu_vllm.sh bench
echo "done at $(( $(date +%s) - t0 )) s"
tar -czf $DEV/callB.tgz -C $V s1
