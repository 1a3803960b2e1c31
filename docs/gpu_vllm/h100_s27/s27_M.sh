#!/usr/bin/env bash
# Archived as it ran: copy it to .calls/ and this folder's sitecustomize.py to .calls/diag27/ (the vLLM kit's second call carries no docs/).
# session 27 call M: GRPO with vLLM at 8 Qwen3-8B layers (eager), jetrl then bf16, then jetrl with gc frozen/disabled
# during rollouts; .calls/diag27/sitecustomize.py times a fixed Python loop in the trainer's main thread and in a bare
# helper process around every rollout, with schedstat, per-CPU busy, other processes' CPU and cpu MHz.
cd "$(dirname "$0")/.." && nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv,noheader
t0=$(date +%s)
bash .kits/vllm/unpack.sh --need-complete 2>&1 | tail -1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/a $OUT/b $OUT/c
nproc; lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|NUMA|MHz" | head -12
export PYTHONPATH=$PWD/.calls/diag27
DIAG_OUT=$OUT/a OUT=$OUT/a CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl bf16" RUN_TIMEOUT=200 GRPO_ARGS="run.steps=6" timeout 400 bash tools/gpu_vllm.sh grpo 2>&1 | tail -6
echo "elapsed $(( $(date +%s) - t0 )) s"
DIAG_GC=1 DIAG_OUT=$OUT/b OUT=$OUT/b CONFIG=configs/gpu_8b_shapes.yaml MODES="jetrl" RUN_TIMEOUT=150 GRPO_ARGS="run.steps=6" timeout 160 bash tools/gpu_vllm.sh grpo 2>&1 | tail -3
el=$(( $(date +%s) - t0 )); echo "elapsed $el s"
if [ $el -lt 440 ]; then
  DIAG_OUT=$OUT/c OUT=$OUT/c CONFIG=configs/gpu_8b_shapes.yaml MODES="bf16" RUN_TIMEOUT=110 GRPO_ARGS="run.steps=6" timeout 120 bash tools/gpu_vllm.sh grpo 2>&1 | tail -3
fi
python3 - $OUT <<'PY'
import glob, json, sys, statistics as st
for d in "abc":
    for f in sorted(glob.glob(f"{sys.argv[1]}/{d}/rollouts_*.jsonl")):
        rows = [json.loads(l) for l in open(f)]
        head = rows[0]; rows = [r for r in rows if "wall_s" in r]
        print(f"== {d} {f.split('/')[-1]} gc={head.get('gc')} affinity={head.get('affinity')} siblings0={head.get('siblings0')} numa={[n for n in head.get('numa_nodes') or [] if n.startswith('node')]} {head.get('model')}")
        for i, r in enumerate(rows):
            busy_sib = [r["cpu_busy"].get(str(c)) for c in r["siblings"] if c != r["main_cpu_end"]]
            print(f"  {i}: wall {r['wall_s']:.3f} cpu {r['main_cpu_s']:.3f} runq {r['runq_wait_s']:.3f} slices {r['slices']} parse {r['parse_s']:.3f}/{r['parse_n']}"
                  f" | calib main {1e3*r['calib_main_before']:.1f}/{1e3*r['calib_main_after']:.1f} helper {1e3*r['calib_helper_before']:.1f}/{1e3*r['calib_helper_after']:.1f} ms"
                  f" | cpu {r['main_cpu_start']}->{r['main_cpu_end']} sib {r['siblings']} sib busy {busy_sib} mhz {min(r['mhz_after']):.0f}-{max(r['mhz_after']):.0f}"
                  f" | busiest cpus {sorted(r['cpu_busy'].items(), key=lambda kv: -kv[1])[:3]} | other {r['other_procs_cpu_s'][:3]}")
PY
for d in a b c; do sed -n 1,4p $OUT/$d/vllm/table.md 2>/dev/null; done
