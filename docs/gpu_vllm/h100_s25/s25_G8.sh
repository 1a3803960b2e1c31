# session 25 call G8: which threads of the GRPO process use the CPU (jetrl, then bf16; configs/gpu_8b_shapes.yaml with
# vLLM, 8 steps): G4/G7 found jetrl's rollout ~30% slower than bf16's in the loop while bench_vllm decodes both at the
# same rate, and cProfile (G6) shows every Python function of vLLM's loop ~20% slower in the jetrl process.
T0=$(date +%s)
OUT=${OUT:-out}; W=/tmp/s25g8; mkdir -p $OUT $W
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
for mode in jetrl bf16; do
  el $mode
  ( OUT=$W/$mode CONFIG=configs/gpu_8b_shapes.yaml MODES=$mode RUN_TIMEOUT=200 \
    GRPO_ARGS="run.steps=8 rollout.enforce_eager=false" timeout 230 bash tools/gpu_vllm.sh grpo > $W/grpo_$mode.log 2>&1 ) &
  bg=$!
  sleep 45
  for i in 1 2 3 4 5 6 7 8 9 10 11 12; do
    pid=$(pgrep -f "megatron_jetrl.rl.train" | head -1)
    [ -n "$pid" ] && top -H -b -n 1 -d 0.5 -p $pid 2>/dev/null | sed -n '7,18p' >> $W/threads_$mode.txt && echo "--" >> $W/threads_$mode.txt
    sleep 2
  done
  wait $bg
  grep -E "^\| $mode" $W/grpo_$mode.log | head -2
  echo "top threads by CPU% over 12 samples ($mode):"
  awk '$9 ~ /^[0-9.]+$/ {c[$12]+=$9; n[$12]++} END {for (k in c) printf "%8.1f %s\n", c[k]/12, k}' $W/threads_$mode.txt | sort -rn | head -12
done
el done; tar -czf $OUT/s25_G8.tgz -C $W threads_jetrl.txt threads_bf16.txt grpo_jetrl.log grpo_bf16.log 2>/dev/null
