#!/usr/bin/env bash
# Archived as it ran: copy it to .calls/ and this folder's sitecustomize.py to .calls/diag27/ (the vLLM kit's second call carries no docs/).
# session 27 call T: one jetrl GRPO run with vLLM (decode graphs), the diag27 probe naming the busy child process
cd "$(dirname "$0")/.." && OUT=${OUT:-/tmp/out}; W=/tmp/runs; mkdir -p $W/t
bash .kits/vllm/unpack.sh --need-complete 2>&1 | tail -1
export PYTHONPATH=$PWD/.calls/diag27
DIAG_OUT=$W/t OUT=$W/t CONFIG=configs/gpu_8b_shapes.yaml MODES=jetrl RUN_TIMEOUT=300 GRPO_ARGS="run.steps=6 rollout.enforce_eager=false" timeout 320 bash tools/gpu_vllm.sh grpo >/dev/null 2>&1
sed -n 3p $W/t/vllm/table.md | cut -d'|' -f2-9
python3 - $W/t <<'PY'
import glob, json, sys
for f in glob.glob(f"{sys.argv[1]}/rollouts_*.jsonl"):
    for l in open(f):
        r = json.loads(l)
        if "wall_s" in r:
            print(round(r["wall_s"], 3), round(1e3 * r["calib_main_before"], 1), r["other_procs_cpu_s"][:2])
            for i in r.get("other_procs_info", [])[:1]:
                print("   ", i)
PY
cp $W/t/rollouts_*.jsonl $OUT/ 2>/dev/null
