#!/usr/bin/env bash
# session 28 call C (warm machine after B): vLLM jetrl at the bench default (prompt 256, 512 new; batches 128, 256),
# then bf16 at both settings, each with decode profiles; the two reports (rates + FP8 ceiling); DeepGEMM's JIT saved.
cd "$(dirname "$0")/.." && t0=$(date +%s); DEV=${OUT:-/tmp/out}; V=/tmp/v; mkdir -p $V/s1 $V/s2
S1="--prompt 512 --new 1024 --batches 128 192 --reps 1 --sync-reps 2 --kv-gb 46 --profile-batch 128 192"
S2="--prompt 256 --new 512 --batches 128 256 --reps 2 --sync-reps 2 --kv-gb 32 --profile-batch 128 256"
OUT=$V/s2 RUNS=jetrl BENCH_ARGS="$S2" timeout 200 bash tools/gpu_vllm.sh bench; echo "at $(( $(date +%s) - t0 )) s"
OUT=$V/s1 RUNS=bf16 BENCH_ARGS="$S1" timeout 180 bash tools/gpu_vllm.sh bench; echo "at $(( $(date +%s) - t0 )) s"
OUT=$V/s2 RUNS=bf16 BENCH_ARGS="$S2" timeout 150 bash tools/gpu_vllm.sh bench; echo "at $(( $(date +%s) - t0 )) s"
for s in s1 s2; do OUT=$V/$s bash tools/gpu_vllm.sh report 2>&1 | grep -v '^== stage'; done
OUT=$DEV bash tools/gpu_vllm.sh jit-save 2>&1 | tail -1
tar -czf $DEV/callC.tgz -C $V s1 s2
echo "done at $(( $(date +%s) - t0 )) s"
