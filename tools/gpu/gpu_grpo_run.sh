#!/usr/bin/env bash
# Short GRPO runs on one GPU, one per precision mode, with per-phase times (BENCHMARKS.md
# "GRPO on one H200: jetrl vs bf16").
#
#   bash tools/gpu/gpu_grpo_run.sh [section.key=value ...]        # extra overrides go to every run
#
# Each mode runs `python -m megatron_jetrl.rl.train $CONFIG precision.mode=<mode> run.name=gpu_<mode>` under
# `timeout` (world size 1: the trainer sets up its own process group), with nvidia-smi sampling GPU memory.
# Afterwards each run's metrics.jsonl, a results.json (summaries, wall times, exit codes, peak memory) and
# table.md (means over steps 1.. , i.e. without the first step) are in $OUT, with a profiled step's
# profile_step<N>_rank<R>.json (run.profile_step) as <run>.profile_step<N>_rank<R>.json; the run's checkpoint is deleted.
#
# Environment (all optional):
#   OUT          where results go (default out/gpu_grpo; the device tool sets it)
#   CONFIG       default configs/gpu_1p5b.yaml
#   MODES        default "jetrl bf16 bf16-train-fp8-rollout"
#   RUN_TIMEOUT  seconds per run (default 200), start-up included
#   WORK         run directories (default /dev/shm/jetrl_grpo when /dev/shm has >= 40 GB free, else
#                ${TMPDIR:-/tmp}/jetrl_grpo); each is deleted after its files are copied
#   PYTHON       default python3
#   (a COMMIT file in the repo root, as in a `git archive` snapshot, names the commit in the log)
#   SITE         where .whl/*.whl are installed when megatron-core or math-verify is missing (default ${TMPDIR:-/tmp}/mcore)
#   SUFFIX       appended to each run's name (gpu_<mode><SUFFIX>), e.g. _native for a second program of a mode
#   PORT_BASE    MASTER_PORT of the first run minus 1 (default 29610; each mode takes the next port): distinct values
#                let two instances run side by side on two GPUs
#
# CPU dry run (tiny shapes):
#   OUT=/tmp/o PYTHON=/work/venv/bin/python bash tools/gpu/gpu_grpo_run.sh run.device=cpu run.steps=2 \
#     'model.hf_config={model_type: qwen2, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,
#      num_attention_heads: 2, num_key_value_heads: 2, head_dim: 128, vocab_size: 512, tie_word_embeddings: true,
#      max_position_embeddings: 128, eos_token_id: 2}' rollout.n=2 rollout.max_new_tokens=4 grpo.prompts_per_step=4 \
#     grpo.micro_batch_size=4 warmup.steps=2
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
OUT=${OUT:-$repo/out/gpu_grpo}
CONFIG=${CONFIG:-configs/gpu_1p5b.yaml}
MODES=${MODES:-"jetrl bf16 bf16-train-fp8-rollout"}
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
if [ -z "${WORK:-}" ]; then  # the final checkpoint (~24 GB at 1.5B with optimizer state) is written to RAM when it fits
  shm=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
  if [ "${shm:-0}" -ge 40 ]; then WORK=/dev/shm/jetrl_grpo; else WORK=${TMPDIR:-/tmp}/jetrl_grpo; fi
fi
PY=${PYTHON:-python3}
SITE=${SITE:-${TMPDIR:-/tmp}/mcore}
mkdir -p "$OUT" "$WORK"
log=$OUT/run.log

export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}

if ! "$PY" -c "import megatron.core, math_verify" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "megatron-core/math-verify missing and no wheels in .whl/" | tee -a "$log"; exit 3; }
  t0=$(date +%s.%N)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl 2>&1 | tee -a "$log"
  export PYTHONPATH=$SITE:$PYTHONPATH
  "$PY" -c "import megatron.core, math_verify" || { echo "install from .whl/ failed" | tee -a "$log"; exit 3; }
  echo "installed .whl/ into $SITE in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s" | tee -a "$log"
fi
{
  echo "work dir $WORK"
  echo "== $(date -u +%FT%TZ) commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?') config $CONFIG modes: $MODES overrides: $*"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)" 2>/dev/null \
    || "$PY" -c "import torch; print('torch', torch.__version__)"
} 2>&1 | tee -a "$log"

port=${PORT_BASE:-29610}
for mode in $MODES; do
  name=gpu_$mode${SUFFIX:-}
  port=$((port + 1))
  dir=$WORK/$name
  rm -rf "$dir"
  mem=$WORK/$name.mem
  : >"$mem"
  smi_pid=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$mem" 2>/dev/null &
    smi_pid=$!
  fi
  echo "== $mode: $(date -u +%TZ)" | tee -a "$log"
  t0=$(date +%s.%N)
  MASTER_PORT=$port timeout -k 15 "$RUN_TIMEOUT" "$PY" -m megatron_jetrl.rl.train "$CONFIG" "precision.mode=$mode" "run.name=$name" \
    "run.out_dir=$dir" "$@" 2>&1 | grep --line-buffered -v -E "UserWarning|warnings.warn\(" | tee -a "$log"
  rc=${PIPESTATUS[0]}
  wall=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null && wait "$smi_pid" 2>/dev/null
  echo "== $mode: exit $rc, wall $wall s" | tee -a "$log"
  echo "{\"mode\": \"$mode\", \"rc\": $rc, \"wall_s\": $wall}" >"$WORK/$name.run.json"
  [ -f "$dir/metrics.jsonl" ] && cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl"
  [ -f "$dir/summary.json" ] && cp "$dir/summary.json" "$WORK/$name.summary.json"
  for f in "$dir"/profile_step*_rank*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name.$(basename "$f")"; done  # run.profile_step
  ls -la "$dir/checkpoints" 2>/dev/null | tail -n +2 | tee -a "$log"
  du -sh "$dir" 2>/dev/null | tee -a "$log"
  rm -rf "$dir"
done

WORK=$WORK OUT=$OUT MODES=$MODES SUFFIX=${SUFFIX:-} "$PY" - <<'EOF' 2>&1 | tee -a "$log"
import json, os, statistics
from pathlib import Path

work, out = Path(os.environ["WORK"]), Path(os.environ["OUT"])
modes = os.environ["MODES"].split()
PH = ["rollout", "eval", "update", "sync", "step"]
results = {}
for mode in modes:
    name = f"gpu_{mode}{os.environ['SUFFIX']}"
    r = json.loads((work / f"{name}.run.json").read_text())
    mfile = out / f"{name}.metrics.jsonl"
    rows = [json.loads(l) for l in mfile.read_text().splitlines() if l.strip()] if mfile.exists() else []
    mem = [int(x) for x in (work / f"{name}.mem").read_text().split() if x.strip().isdigit()] if (work / f"{name}.mem").exists() else []
    r["peak_gpu_mem_gib"] = max(mem) / 1024 if mem else None
    sf = work / f"{name}.summary.json"
    r["summary"] = json.loads(sf.read_text()) if sf.exists() else None
    r["steps"] = len(rows)
    use = rows[1:] if len(rows) > 1 else rows
    mean = lambda k: statistics.fmean([x[k] for x in use if x.get(k) is not None]) if any(x.get(k) is not None for x in use) else None
    r["mean_excl_step0"] = {p: mean(f"time/{p}") for p in PH}
    r["step0"] = {p: rows[0].get(f"time/{p}") for p in PH} if rows else None
    r["tokens_per_s"] = mean("throughput/tokens_per_s")
    toks = [x["throughput/tokens_per_s"] * x["time/step"] for x in use] if use else []
    r["response_tokens_per_step"] = statistics.fmean(toks) if toks else None
    r["rollout_tokens_per_s"] = (r["response_tokens_per_step"] / r["mean_excl_step0"]["rollout"]) if toks else None
    r["sync_GB"] = mean("sync/bytes") / 1e9 if mean("sync/bytes") is not None else None
    for k in ("mismatch/mean_abs_diff", "mismatch/k3_kl", "mismatch/max_abs_diff", "reward/mean", "response_length/mean", "grad_norm", "loss/total"):
        r[k] = mean(k)
    r["mismatch_max_over_steps"] = max((x.get("mismatch/max_abs_diff") or 0) for x in rows) if rows else None
    r["startup_s"] = r["wall_s"] - sum(x["time/step"] for x in rows) if rows else None
    parts = sorted({k for x in use for k in x if (k.startswith("sync/") and k.endswith("_s")) or k.startswith("rollout/sleep")})
    r["parts"] = {k: mean(k) for k in parts}  # a colocated (vLLM) pool's sync parts and sleep, means like the phases
    results[mode + os.environ["SUFFIX"]] = r
(out / "results.json").write_text(json.dumps(results, indent=1))

f = lambda v, s=".3f": "n/a" if v is None else format(v, s)
lines = ["| mode | exit | steps | rollout s | eval s | update s | sync s | step s | resp. tok/s (step) | rollout tok/s | "
         "sync GB | mismatch mean abs dlogp | mismatch k3 KL | max abs dlogp | reward | peak GPU mem GiB | wall s | start-up+save s |",
         "|" + "---|" * 18]
for mode, r in results.items():
    m = r["mean_excl_step0"]
    lines.append(f"| {mode} | {r['rc']} | {r['steps']} | " + " | ".join(f(m[p]) for p in PH) +
                 f" | {f(r['tokens_per_s'], '.0f')} | {f(r['rollout_tokens_per_s'], '.0f')} | {f(r['sync_GB'], '.3f')} | {f(r['mismatch/mean_abs_diff'], '.4g')} | "
                 f"{f(r['mismatch/k3_kl'], '.3g')} | {f(r['mismatch_max_over_steps'], '.3g')} | {f(r['reward/mean'], '.3f')} | "
                 f"{f(r['peak_gpu_mem_gib'], '.1f')} | {f(r['wall_s'], '.0f')} | {f(r['startup_s'], '.0f')} |")
if "jetrl" in results and "bf16" in results:
    a, b = results["bf16"]["mean_excl_step0"], results["jetrl"]["mean_excl_step0"]
    lines += ["", "bf16 time / jetrl time (>1: jetrl faster): " + ", ".join(
        f"{p} {a[p] / b[p]:.3f}x" if a[p] and b[p] else f"{p} n/a" for p in PH)]
for mode, r in results.items():
    if r["parts"]:
        lines += ["", f"{mode} sync parts and sleep (means, s; GiB released): " + ", ".join(f"{k} {f(v)}" for k, v in r["parts"].items())]
lines += ["", "step 0 (not in the means): " + "; ".join(
    f"{mode} " + " ".join(f"{p} {f(r['step0'][p], '.2f')}" for p in PH) for mode, r in results.items() if r["step0"])]
table = "\n".join(lines)
(out / "table.md").write_text(table + "\n")
print(table)
EOF
