#!/usr/bin/env bash
# session 28 calls H2/H3 (after the vLLM kit's first call): vLLM jetrl with vLLM's Triton block-FP8 kernel
# (--variant triton-gemm) and, in the next call on the same machine, the shipped engine (DeepGEMM), both at the
# bench's default setting (prompt 256, 512 new), batches 128 and 256, decode profiles at batch 128.
cd "$(dirname "$0")/.." && t0=$(date +%s); DEV=${OUT:-/tmp/out}; V=/tmp/v; mkdir -p $V/t
bash .kits/vllm/unpack.sh 2>&1 | tail -1
echo "unpacked at $(( $(date +%s) - t0 )) s; $(nvidia-smi --query-gpu=name,power.limit --format=csv,noheader)"
OUT=$V/t RUNS=${RUNS:-jetrl:triton-gemm} BENCH_ARGS="--prompt 256 --new 512 --batches 128 256 --reps 2 --sync-reps 2 --kv-gb 32 --profile-batch 128" \
  timeout 400 bash tools/gpu_vllm.sh bench
echo "done at $(( $(date +%s) - t0 )) s"
tar -czf $DEV/callH_$(echo ${RUNS:-jetrl:triton-gemm} | tr : _).tgz -C $V t 2>/dev/null || tar -czf $DEV/callH.tgz -C $V t
