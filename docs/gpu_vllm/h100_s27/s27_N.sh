#!/usr/bin/env bash
# Archived as it ran: copy it to .calls/ and this folder's sitecustomize.py to .calls/diag27/ (the vLLM kit's second call carries no docs/).
# session 27 call N (warm machine after M): jetrl plain, jetrl with gc frozen/disabled in rollouts, bf16, jetrl plain
cd "$(dirname "$0")/.." && t0=$(date +%s); OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD/.calls/diag27
i=0
for spec in jetrl:0 jetrl:1 bf16:0 jetrl:0 bf16:0; do
  el=$(( $(date +%s) - t0 )); [ $el -gt 470 ] && break
  i=$((i+1)); m=${spec%:*}; g=${spec#*:}; d=$OUT/r$i; mkdir -p $d
  DIAG_GC=$g DIAG_OUT=$d OUT=$d CONFIG=configs/gpu_8b_shapes.yaml MODES=$m RUN_TIMEOUT=140 GRPO_ARGS="run.steps=6" timeout 150 bash tools/gpu_vllm.sh grpo >/dev/null 2>&1
  echo "r$i $m gc=$g: $(sed -n 3p $d/vllm/table.md | cut -d'|' -f2-9) elapsed $(( $(date +%s) - t0 ))"
  python3 - $d <<'PY'
import glob, json, sys
for f in glob.glob(f"{sys.argv[1]}/rollouts_*.jsonl"):
    rows = [json.loads(l) for l in open(f) if "wall_s" in l]
    print("   gen wall", [round(r["wall_s"], 3) for r in rows], "calib main", [round(1e3 * r["calib_main_before"], 1) for r in rows],
          "other", [r["other_procs_cpu_s"][:1] for r in rows])
PY
done
