#!/usr/bin/env bash
# session 27 call Q: every non-vLLM GPU test on today's tree (regression run), with TE and DeepGEMM kits
cd "$(dirname "$0")/../../.." && OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
bash tools/gpu_fp8.sh setup 2>&1 | tail -4
export PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD; [ -f .kits/te/bin/env.sh ] && source .kits/te/bin/env.sh
timeout 500 bash tools/run_gpu_tests.sh tests/gpu/test_kernels.py tests/gpu/test_fused.py tests/gpu/test_triton_launch.py \
  tests/gpu/test_decode_graphs.py tests/gpu/test_distributed_optimizer_gpu.py tests/gpu/test_convert_transformers_gpu.py \
  tests/gpu/test_bench_rollout_smoke.py tests/gpu/test_te.py tests/gpu/test_actor_tp_gpu.py tests/gpu/test_te_tp_gpu.py \
  -rfE --durations=12 --junitxml=$OUT/gpu_tests.xml 2>&1 | tail -45
