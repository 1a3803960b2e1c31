#!/usr/bin/env bash
# CI: the SLURM launch path on a real single-node SLURM cluster brought up on this machine.
#
#   bash .ci/slurm.sh                                          # the real trainer (megatron_jetrl.rl.train)
#   JETRL_TRAIN_MODULE=tests.unit.stub_train bash .ci/slurm.sh  # the launcher against the stub trainer
#
# 1. installs Debian's slurmctld slurmd slurm-client munge when missing (needs root), starts munged (as user
#    munge), writes a minimal slurm.conf in a temp dir (SlurmUser=root, one node with CPUs=$(nproc), free ports),
#    starts `slurmctld -D -i` and `slurmd -D` and waits until sinfo shows the node idle;
# 2. `sbatch --wait launch/slurm/train_grpo.sbatch [CONFIG] parallel.tp=2 run.steps=N ...` (2 CPU ranks, TP2):
#    checks the exit code, metrics.jsonl (N steps, tp 2), summary.json and the exported FP8 checkpoint
#    (tools/verify_fp8_checkpoint.py <out>/export --rollout-tp 1 2);
# 3. `sbatch --wait launch/slurm/tp_sweep.sbatch` (default TP list 1 2 4 8 x the three precision modes): TP 1 and 2
#    must succeed, the larger sizes must be reported skipped (more processes than CPUs) or invalid (the config
#    refuses them, e.g. the tiny model's 2 KV heads do not split 4 ways), the report (.md + .csv) must exist;
# 4. stops the daemons it started (always, on exit) and exits non-zero with a message on any failure.
#
# Environment: PYTHON (default .venv/bin/python, else python3), JETRL_TRAIN_MODULE / JETRL_CONFIG_MODULE (see
# launch/train_grpo.sh), JETRL_CI_CONFIG (config file for both jobs; default: the trainer's default),
# JETRL_CI_OVERRIDES (extra section.key=value overrides for every run, word-split, e.g. "warmup.steps=5"),
# JETRL_CI_SWEEP_OVERRIDES (overrides for the sweep's runs only; default "warmup.steps=0", set it empty for none: the sweep times GRPO steps,
# the tiny default's supervised warm-start before them is minutes of CPU it does not measure),
# JETRL_CI_STEPS (train job steps, default 3), JETRL_CI_SWEEP_STEPS (default 2), JETRL_CI_JOB_MINUTES (time limit
# of each job, default 30), JETRL_CI_KEEP=1 (keep the temp dir with logs and runs).
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac  # the header above, nothing run

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
t_start=$(date +%s)

say() { echo "[ci/slurm $(($(date +%s) - t_start))s] $*"; }
fail() {
  echo "[ci/slurm] FAILED: $*" >&2
  exit 1
}
trap 'rc=$?; [ "$rc" -eq 0 ] || echo "[ci/slurm] FAILED: command at line $LINENO exited with $rc" >&2' ERR

py=$(bash "$repo/launch/python.sh")
export PYTHON=$py
"$py" -c 'import torch, yaml' 2>/dev/null ||
  fail "'$py' cannot import torch and yaml; run 'bash tools/test.sh' (creates .venv) or set PYTHON=/path/to/venv/bin/python"
steps=${JETRL_CI_STEPS:-3}
sweep_steps=${JETRL_CI_SWEEP_STEPS:-2}
minutes=${JETRL_CI_JOB_MINUTES:-30}
config=()
if [ -n "${JETRL_CI_CONFIG:-}" ]; then
  config=("$JETRL_CI_CONFIG")
fi
read -r -a extra <<<"${JETRL_CI_OVERRIDES:-}"
read -r -a sweep_extra <<<"${JETRL_CI_SWEEP_OVERRIDES-warmup.steps=0}"
say "trainer module: ${JETRL_TRAIN_MODULE:-megatron_jetrl.rl.train}, python: $py"

# ---------------------------------------------------------------- packages
missing=()
for cmd in slurmctld slurmd sbatch sinfo scontrol munged munge unmunge; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || fail "missing ${missing[*]}; install them as root: apt-get install slurmctld slurmd slurm-client munge"
  say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt_install=(apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge)
  if ! "${apt_install[@]}" >/tmp/jetrl-ci-apt.log 2>&1; then
    apt-get update -q >>/tmp/jetrl-ci-apt.log 2>&1 || true
    "${apt_install[@]}" >>/tmp/jetrl-ci-apt.log 2>&1 || { tail -n 20 /tmp/jetrl-ci-apt.log >&2; fail "apt-get install failed (log /tmp/jetrl-ci-apt.log)"; }
  fi
fi
[ "$(id -u)" -eq 0 ] || fail "the test cluster runs its daemons as root (SlurmUser=root); run as root"

# ---------------------------------------------------------------- cluster
work=$(mktemp -d /tmp/jetrl-slurm-ci.XXXXXX)
out=$work/out
mkdir -p "$work/state" "$work/spool" "$out"
ctld_pid=""
submit_pid=""
slurmd_pid=""
munged_started=0

stop_pid() {  # pid name
  local pid=$1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  echo "[ci/slurm] $2 (pid $pid) did not stop on SIGTERM; killing it" >&2
  kill -9 "$pid" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  set +e
  trap - ERR
  if [ -n "$ctld_pid" ] && kill -0 "$ctld_pid" 2>/dev/null; then
    jobs_left=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs_left" ]; then  # interrupted: end the jobs' processes before their slurmd goes
      echo "[ci/slurm] cancelling jobs still running: $(echo "$jobs_left" | paste -sd' ')" >&2
      # shellcheck disable=SC2086
      scancel $jobs_left
      for _ in $(seq 60); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
  fi
  stop_pid "$submit_pid" "sbatch --wait"
  stop_pid "$slurmd_pid" slurmd
  stop_pid "$ctld_pid" slurmctld
  if [ "$munged_started" = 1 ] && [ -f /run/munge/munged.pid ]; then
    stop_pid "$(cat /run/munge/munged.pid)" munged
  fi
  if [ "${JETRL_CI_KEEP:-0}" = 1 ] || [ "$rc" -ne 0 ]; then
    echo "[ci/slurm] logs, job outputs and runs kept in $work"
  else
    rm -rf "$work"
  fi
  echo "[ci/slurm] $([ "$rc" -eq 0 ] && echo PASSED || echo "FAILED (exit $rc)") in $(($(date +%s) - t_start)) s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# sbatch --wait in the background, so that a signal to this script is handled at once (cleanup cancels the job)
submit_wait() {
  "$@" &
  submit_pid=$!
  wait "$submit_pid"
}

if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  say "munged already running"
else
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  munged_started=1
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
  munge -n </dev/null | unmunge >/dev/null || fail "munged does not answer (see /var/log/munge/munged.log)"
  say "munged started"
fi

free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
host=$(hostname -s)
ctld_port=$(free_port)
slurmd_port=$(free_port)
[ "$ctld_port" != "$slurmd_port" ] || slurmd_port=$(free_port)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
cat >"$work/slurm.conf" <<EOF
ClusterName=jetrlci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$work/slurmctld.out" 2>&1 &
ctld_pid=$!
slurmd -D -f "$SLURM_CONF" >"$work/slurmd.out" 2>&1 &
slurmd_pid=$!
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.2
done
if [ "$state" != idle ]; then
  tail -n 20 "$work/slurmctld.log" "$work/slurmd.log" >&2 2>/dev/null || true
  fail "node $host is '${state:-not listed}' after 30 s, not idle (logs above, in $work)"
fi
say "cluster up: node $host, $cpus CPUs, slurmctld :$ctld_port, slurmd :$slurmd_port ($(sbatch --version))"

show_job_output() {  # file
  echo "----- $1 (last 40 lines)" >&2
  tail -n 40 "$1" >&2 2>/dev/null || echo "(no output file)" >&2
  echo "-----" >&2
}

# ---------------------------------------------------------------- 1. one GRPO run, TP2 on 2 CPU ranks
train_dir=$out/train
say "job 1: train_grpo.sbatch, TP2 on 2 CPU ranks, $steps steps -> $train_dir"
rc=0
submit_wait sbatch --wait --quiet --job-name=ci-train --time="$minutes" --gpus-per-node=0 --output="$work/train-%j.out" \
  launch/slurm/train_grpo.sbatch "${config[@]}" "${extra[@]}" parallel.tp=2 "run.steps=$steps" run.name=ci_slurm_tp2 \
  "run.out_dir=$train_dir" || rc=$?
train_out=$(find "$work" -maxdepth 1 -name 'train-*.out' | head -n 1)
if [ "$rc" -ne 0 ]; then
  show_job_output "$train_out"
  fail "job 1 (train_grpo.sbatch) exited with $rc"
fi
say "job 1 exited 0; checking $train_dir"
"$py" - "$train_dir" "$steps" <<'EOF' || fail "job 1 wrote an incomplete run (see above)"
import json, sys
from pathlib import Path
sys.path.insert(0, ".")
from megatron_jetrl.rl.metrics import METRIC_KEYS, read_metrics

run, steps = Path(sys.argv[1]), int(sys.argv[2])
lines = [l for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
rows = read_metrics(run)
problems = []
if len(lines) != steps or len(rows) != steps:
    problems.append(f"metrics.jsonl has {len(lines)} lines / {len(rows)} distinct steps, expected {steps}")
for r in rows:
    missing = [k for k in METRIC_KEYS if k not in r]
    if missing:
        problems.append(f"step {r['step']} lacks {missing}")
    if r.get("tp") != 2:
        problems.append(f"step {r['step']} has tp={r.get('tp')!r}, expected 2")
if not (run / "summary.json").is_file():
    problems.append("no summary.json")
if not (run / "config.yaml").is_file():  # in the contract, not needed by anything here: a warning
    print(f"  warning: no config.yaml (the resolved config) in {run}", file=sys.stderr)
if (run / "summary.json").is_file():
    json.loads((run / "summary.json").read_text())
for p in problems:
    print("  " + p, file=sys.stderr)
print(f"  metrics.jsonl: {len(rows)} steps {[r['step'] for r in rows]}, tp {sorted({r.get('tp') for r in rows}, key=str)}")
sys.exit(1 if problems else 0)
EOF
"$py" tools/verify_fp8_checkpoint.py "$train_dir/export" --rollout-tp 1 2 || fail "the exported FP8 checkpoint $train_dir/export does not verify"
say "job 1 ok: exit 0, $steps steps logged, FP8 export verified at rollout TP 1 and 2"

# ---------------------------------------------------------------- 2. TP x precision sweep through the scheduler
sweep_dir=$out/sweep
say "job 2: tp_sweep.sbatch, TP 1 2 4 8 x 3 modes (above $cpus processes: skipped), $sweep_steps steps each${sweep_extra[*]:+, ${sweep_extra[*]}} -> $sweep_dir"
rc=0
submit_wait sbatch --wait --quiet --job-name=ci-sweep --time="$minutes" --gpus-per-node=0 --output="$work/sweep-%j.out" \
  launch/slurm/tp_sweep.sbatch --tp "1 2 4 8" --steps "$sweep_steps" --out "$sweep_dir" -- "${config[@]}" "${sweep_extra[@]}" "${extra[@]}" || rc=$?
sweep_out=$(find "$work" -maxdepth 1 -name 'sweep-*.out' | head -n 1)
if [ "$rc" -ne 0 ]; then
  show_job_output "$sweep_out"
  fail "job 2 (tp_sweep.sbatch) exited with $rc"
fi
if [ ! -s "$sweep_dir/sweep_report.md" ] || [ ! -s "$sweep_dir/sweep_report.csv" ]; then
  show_job_output "$sweep_out"
  fail "job 2 produced no report ($sweep_dir/sweep_report.md/.csv)"
fi
"$py" - "$sweep_dir/sweep_report.csv" "$cpus" <<'EOF' || fail "the sweep report is not what was expected (see above)"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
cpus = int(sys.argv[2])
modes = ("bf16", "bf16-train-fp8-rollout", "jetrl")
got = {(r["tp"], r["mode"]): r for r in rows}
problems = []
for tp in (1, 2, 4, 8):
    for mode in modes:
        r = got.get((str(tp), mode))
        want = ("ok",) if tp <= cpus else ("skipped", "invalid")
        if r is None:
            problems.append(f"no row for TP {tp} {mode}")
        elif r["status"] not in want:
            problems.append(f"TP {tp} {mode}: status {r['status']} ({r['reason']}), expected {' or '.join(want)}")
        elif want == "ok" and not r["time_step"]:
            problems.append(f"TP {tp} {mode}: no step time")
        elif want == "ok" and mode != "bf16" and not r["speedup_step"]:
            problems.append(f"TP {tp} {mode}: no speedup over bf16")
for p in problems:
    print("  " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
cat "$sweep_dir/sweep_report.md"
say "job 2 ok: TP 1 and 2 ran in all modes, larger TP reported skipped/invalid, report written"
