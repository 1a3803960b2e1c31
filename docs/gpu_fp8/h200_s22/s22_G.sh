# session 22 call G: host A/B (this tree vs a5631ef) with the no_grad forward row; the local-layer GPU tests; GRPO gpu_1p5b (eval phase)
T0=$(date +%s)
OUT=${OUT:-out}; mkdir -p $OUT
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash tools/gpu_fp8.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD
el host; timeout 150 python3 -W ignore tools/bench_host.py --against .calls/s22_old --rounds 3 > $OUT/host_ab.log 2>&1; tail -7 $OUT/host_ab.log
el tests; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused.py tests/gpu/test_kernels.py -k "local_layer or fp8_linear_on_cuda or default_fp8_linear or gated_mlp_input" -rf > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
el grpo; MODES="jetrl bf16" RUN_TIMEOUT=190 timeout 250 bash tools/gpu_grpo_run.sh run.steps=4 > $OUT/grpo.log 2>&1
grep -E "^\| (jetrl|bf16) |bf16 time" $OUT/grpo.log | head -4
el done
