# session 25 call G6: cProfile of the vLLM rollout's host side inside GRPO (configs/gpu_8b_shapes.yaml, 6 steps),
# jetrl then bf16 (.calls/s25_prof.py).
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25g6; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bash .kits/vllm/unpack.sh --need-complete > $W/unpack.log 2>&1 || { echo "kit incomplete"; exit 3; }
source /tmp/vllm-site/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/*.whl 2>&1 | tail -1
bash tools/jit_cache.sh load > /dev/null 2>&1
export PYTHONPATH=/tmp/mcore:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
for mode in jetrl bf16; do
  el $mode; MASTER_PORT=$((29700 + RANDOM % 100)) timeout 260 python3 .calls/s25_prof.py configs/gpu_8b_shapes.yaml precision.mode=$mode \
    run.name=prof_$mode run.steps=6 rollout.engine=vllm rollout.enforce_eager=false run.out_dir=$W/run_$mode > $W/prof_$mode.log 2>&1; echo "rc $?"
  grep -E "^\[prof\]" $W/prof_$mode.log
done
el done; tar -czf $OUT/s25_G6.tgz -C $W prof_jetrl.log prof_bf16.log 2>/dev/null
