#!/usr/bin/env bash
# session 27 call S: the skinny-M FP8 GEMM prototype against DeepGEMM at decode shapes (one H100)
cd "$(dirname "$0")/../../.." && OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash tools/gpu_fp8.sh setup 2>&1 | tail -1
export PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
timeout 420 python3 docs/gpu_vllm/h100_s27/s27_skinny.py $OUT/skinny.json 2>&1 | grep -v Warning | tail -12
