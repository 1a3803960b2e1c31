#!/usr/bin/env bash
# Archived as it ran: copy it to .calls/ and this folder's sitecustomize.py to .calls/diag27/ (the vLLM kit's second call carries no docs/).
# session 27 call P: GRPO with vLLM at 8 Qwen3-8B layers with decode CUDA graphs (rollout.enforce_eager=false),
# jetrl and bf16 alternating, with the diag27 sampler (fixed-loop CPU calibration, DeepGEMM JIT kernels compiled in each rollout)
cd "$(dirname "$0")/.." && t0=$(date +%s); OUT=${OUT:-/tmp/out}; W=/tmp/runs; mkdir -p $W
bash .kits/vllm/unpack.sh --need-complete 2>&1 | tail -1
export PYTHONPATH=$PWD/.calls/diag27
i=0
for m in jetrl bf16 jetrl bf16; do
  el=$(( $(date +%s) - t0 )); [ $el -gt 400 ] && break
  i=$((i+1)); d=$W/r$i; mkdir -p $d
  DIAG_OUT=$d OUT=$d CONFIG=configs/gpu_8b_shapes.yaml MODES=$m RUN_TIMEOUT=170 GRPO_ARGS="run.steps=6 rollout.enforce_eager=false" timeout 180 bash tools/gpu_vllm.sh grpo >/dev/null 2>&1
  echo "r$i $m: $(sed -n 3p $d/vllm/table.md | cut -d'|' -f2-9) elapsed $(( $(date +%s) - t0 ))"
  python3 - $d <<'PY'
import glob, json, sys
for f in glob.glob(f"{sys.argv[1]}/rollouts_*.jsonl"):
    rows = [json.loads(l) for l in open(f) if "wall_s" in l]
    print("   gen wall", [round(r["wall_s"], 3) for r in rows], "calib main", [round(1e3 * r["calib_main_before"], 1) for r in rows],
          "new jit", [r["jit_after"] - r["jit_before"] for r in rows], "other", [r["other_procs_cpu_s"][:1] for r in rows])
PY
done
tar -czf $OUT/runs.tgz -C $W $(cd $W && ls -d r*/rollouts_*.jsonl r*/vllm/*.metrics.jsonl r*/vllm/table.md r*/vllm/run.log 2>/dev/null)
bash tools/gpu_vllm.sh jit-save 2>&1 | tail -1; ls $OUT
