#!/usr/bin/env bash
# session 26 call K2: GRPO with vLLM at 8 Qwen3-8B layers (eager), jetrl then bf16, with the thread sampler
cd "$(dirname "$0")/.." && nvidia-smi --query-gpu=name --format=csv,noheader
bash .kits/vllm/unpack.sh --need-complete 2>&1 | tail -1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export DIAG_OUT=$OUT PYTHONPATH=$PWD/.calls/diag DIAG_AVOID_CPU0=1
CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16" RUN_TIMEOUT=220 GRPO_ARGS="run.steps=6" timeout 560 bash tools/gpu_vllm.sh grpo 2>&1 | tail -12
for f in $OUT/threads_*.txt; do echo "== $f"; cat $f; done
