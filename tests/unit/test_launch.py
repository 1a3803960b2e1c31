"""launch/train_grpo.sh, launch/tp_sweep.sh and the SLURM scripts, run against tests/unit/stub_train.py.

The stub joins torch.distributed with gloo, so the torchrun rendezvous is real; it records each rank's argv and
environment in <out_dir>/stub_rank<R>.json. The SLURM path itself runs in .ci/slurm.sh (a real cluster); here
the batch script's dry run (JETRL_DRY_RUN=1) resolves a faked 2-node x 8-GPU allocation against the real config.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "launch" / "train_grpo.sh"
SWEEP = REPO / "launch" / "tp_sweep.sh"
SCRIPTS = [TRAIN, SWEEP, REPO / "launch/slurm/train_grpo.sbatch", REPO / "launch/slurm/tp_sweep.sbatch", REPO / ".ci/slurm.sh"]
STUB = "tests.unit.stub_train"
TRICKY = ["run.name=a b", "data.note=$HOME * 'q' \"dq\" ;|&", "stub.tensorboard=false"]


CLEAN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "JETRL_EXIT_DIR",
    "JETRL_NPROC",
    "JETRL_CONFIG_MODULE",
    "JETRL_TORCHRUN_ARGS",
    "TP_SIZES",
    "MODES",
    "SWEEP_STEPS",
    "SWEEP_OUT",
    "JETRL_MAX_PROCS",
    "JETRL_SWEEP_LAUNCH",
)


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in CLEAN}
    e.update(PYTHON=sys.executable, JETRL_TRAIN_MODULE=STUB)
    e.update(extra)
    return e


def run(cmd, cwd, timeout=120, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout)


def ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("stub_rank*.json"))]


def test_scripts_parse_and_are_shellcheck_clean():
    for script in SCRIPTS:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script}: {r.stderr}"
    assert os.access(TRAIN, os.X_OK) and os.access(SWEEP, os.X_OK), "torchrun --no-python needs the launchers executable"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_train_grpo_spawns_world_size_ranks_with_args_verbatim(tmp_path):
    out = tmp_path / "run"
    args = ["parallel.tp=2", f"run.out_dir={out}", "stub.export=false", *TRICKY]
    r = run(["bash", TRAIN, *args], cwd=tmp_path)  # any working directory: the launcher puts the repo on the path
    assert r.returncode == 0, r.stdout + r.stderr
    seen = ranks(out)
    assert [s["rank"] for s in seen] == [0, 1]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for s in seen:
        assert s["argv"] == args
        assert s["world_size"] == 2 and s["env"]["WORLD_SIZE"] == "2" and s["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert s["env"]["OMP_NUM_THREADS"] == threads and s["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
        assert s["env"]["JETRL_EXIT_DIR"] and not Path(s["env"]["JETRL_EXIT_DIR"]).exists()  # removed afterwards
        assert Path(s["cwd"]).resolve() == tmp_path.resolve()
    assert "train_grpo.sh: 2 process(es)" in r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert "GRPO run: 3 steps, mode jetrl, TP 2 PP 1 DP 1" in r.stdout


def test_train_grpo_returns_the_failing_ranks_exit_code(tmp_path):
    # rank 1 exits 7 while rank 0 carries on: torchrun says 1, the launcher says 7
    r = run(
        [
            "bash",
            TRAIN,
            "parallel.tp=2",
            f"run.out_dir={tmp_path / 'a'}",
            "stub.export=false",
            "stub.exit_code=7",
            "stub.fail_rank=1",
        ],
        cwd=tmp_path,
        OMP_NUM_THREADS="1",
    )
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stderr.rstrip().endswith(
        "the run failed with exit code 7 (torchrun: 1): rank 1 failed first (exit code 7); its error is above"
    )
    assert json.loads((tmp_path / "a" / "stub_rank0.json").read_text())["env"]["OMP_NUM_THREADS"] == "1"  # not overridden


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen(
        ["bash", str(TRAIN), "parallel.tp=2", f"run.out_dir={out}", "stub.sleep=120", "stub.export=false"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(out.glob("stub_rank*.json"))) < 2:
            assert p.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [s["pid"] for s in ranks(out)]
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc != 0
    time.sleep(0.5)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    assert not alive, f"ranks {alive} outlived their launcher"


def test_launcher_edited_while_it_runs_carries_on(tmp_path):
    """bash reads a script while it runs it: the launcher is one function called on its last line, so rewriting the
    file in place mid-run (a checkout of another version) changes nothing in the launcher or the ranks running it."""
    copy = tmp_path / "repo" / "launch" / "train_grpo.sh"
    copy.parent.mkdir(parents=True)
    shutil.copy2(TRAIN, copy)
    shutil.copy2(REPO / "launch" / "python.sh", copy.parent)
    out = tmp_path / "run"
    p = subprocess.Popen(
        ["bash", str(copy), "parallel.tp=2", f"run.out_dir={out}", "stub.sleep=1", "stub.export=false", "stub.tensorboard=false"],
        cwd=tmp_path,
        env=env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(out.glob("stub_rank*.json"))) < 2:  # the launcher waits on torchrun, the ranks on python
            assert p.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        text = copy.read_text()
        with open(copy, "r+") as f:  # the same file, rewritten: every offset after the first line moves by 60 bytes
            f.write("#!/usr/bin/env bash\n# " + "-" * 57 + "\n" + text.split("\n", 1)[1])
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "GRPO run: 3 steps" in stdout, stderr
    assert "command not found" not in stderr and "syntax error" not in stderr, stderr


def test_torchrun_no_python_runs_the_rank_directly(tmp_path):
    out = tmp_path / "run"
    args = ["parallel.tp=2", f"run.out_dir={out}", "stub.export=false", "stub.tensorboard=false", "run.name=x y"]
    r = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python", TRAIN, *args],
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    seen = ranks(out)
    assert [(s["rank"], s["world_size"], s["argv"]) for s in seen] == [(0, 2, args), (1, 2, args)]
    assert "train_grpo.sh: 2 process(es)" not in r.stderr  # no second torchrun


def test_train_grpo_errors_name_the_fix(tmp_path):
    # the config module refuses the arguments: its exit code and a message naming the fix
    r = run(["bash", TRAIN, "parallel.tp=2", "oops"], cwd=tmp_path)
    assert r.returncode == 2
    assert "override 'oops' is not section.key=value" in r.stderr and "JETRL_NPROC" not in r.stderr  # its message alone
    r = run(["bash", TRAIN], cwd=tmp_path, JETRL_CONFIG_MODULE="no_such_config_module")
    assert r.returncode != 0 and "no_such_config_module --get parallel.world_size' failed" in r.stderr
    r = run(["bash", TRAIN], cwd=tmp_path, JETRL_NPROC="two")
    assert r.returncode == 2 and "positive integer, got 'two' (from JETRL_NPROC)" in r.stderr
    r = run(["bash", TRAIN], cwd=tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert r.returncode == 2 and "not found; set PYTHON=" in r.stderr
    r = run(["bash", TRAIN, "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "JETRL_TRAIN_MODULE" in r.stdout and not r.stdout.startswith("#")


def test_the_launcher_completes_a_missing_or_half_built_venv_once(tmp_path):
    """The repository's .venv is made where it is missing and completed where it lacks the mark of a finished setup
    (an interrupted first run), each said in one line; a complete one is left alone. A stand-in tools/setup.sh in a
    copy of the launchers records its calls and writes the mark as the real one does."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copytree(REPO / "launch", repo / "launch")
    (repo / "requirements.txt").write_text("torch==2.13.0\n")
    (repo / "tools" / "setup.sh").write_text(f"""set -e
cd "$(dirname "$0")/.."
echo call >>setup.calls
mkdir -p .venv/bin && printf '#!/bin/sh\\nexec {sys.executable} "$@"\\n' >.venv/bin/python && chmod +x .venv/bin/python
cat tools/setup.sh requirements.txt | sha256sum | cut -d' ' -f1 >.venv/.jetrl-setup
""")
    e = {k: v for k, v in env(PYTHONPATH=str(REPO)).items() if k not in ("PYTHON", "JETRL_TRAIN_MODULE")}

    def launch():  # a bad key: the config module refuses, exit 2, after the venv step
        r = subprocess.run(
            ["bash", str(repo / "launch" / "train_grpo.sh"), "run.stpes=3"],
            cwd=tmp_path,
            env=e,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "did you mean 'steps'" in r.stderr, r.stderr
        return r.stderr

    assert "first run: creating" in launch() and (repo / "setup.calls").read_text() == "call\n"
    assert "creating" not in launch() and "incomplete" not in launch()  # complete: no setup
    assert (repo / "setup.calls").read_text() == "call\n"
    (repo / ".venv" / ".jetrl-setup").unlink()  # an interrupted setup leaves no mark
    assert "is incomplete or older than requirements.txt (an interrupted first run?): completing it" in launch()
    (repo / "requirements.txt").write_text("torch==2.13.0\npyyaml\n")  # changed requirements: completed again
    assert "completing it" in launch() and (repo / "setup.calls").read_text() == "call\n" * 3


def test_tp_sweep_runs_skips_and_reports(tmp_path):
    # one process per run (the stub without torchrun) keeps this fast; train_grpo.sh is covered above
    out = tmp_path / "sweep"
    r = run(
        [
            "bash",
            SWEEP,
            "--tp",
            "1 2 4 8",
            "--modes",
            "bf16 jetrl bf16-train-fp8-rollout",
            "--steps",
            "3",
            "--out",
            out,
            "--max-procs",
            "2",
            "stub.export=false",
            "stub.tensorboard=false",
            "stub.fail_mode=bf16-train-fp8-rollout",
            "stub.exit_code=3",
            "stub.max_tp=4",
        ],
        cwd=tmp_path,
        JETRL_SWEEP_LAUNCH=f"{sys.executable} -m {STUB}",
    )
    assert r.returncode == 1, r.stdout + r.stderr  # a run failed: non-zero, but the report is written
    assert "sweep_tp4_jetrl: skipped: needs 4 processes, 2 available (--max-procs/JETRL_MAX_PROCS)" in r.stdout
    assert "sweep_tp1_bf16-train-fp8-rollout: FAILED with exit code 3" in r.stderr
    refused = "parallel.tp=8: TP=8 does not divide num_key_value_heads=4"
    assert f"sweep_tp8_jetrl: invalid, not run: stub_train: error: {refused}" in r.stdout
    rows = list(csv.DictReader(open(out / "sweep_report.csv")))
    assert [(r_["tp"], r_["mode"], r_["status"], r_["reason"]) for r_ in rows] == [
        ("1", "bf16", "ok", ""),
        ("1", "bf16-train-fp8-rollout", "failed", "exit code 3"),
        ("1", "jetrl", "ok", ""),
        ("2", "bf16", "ok", ""),
        ("2", "bf16-train-fp8-rollout", "failed", "exit code 3"),
        ("2", "jetrl", "ok", ""),
        ("4", "bf16", "skipped", "needs 4 processes, 2 available"),
        ("4", "bf16-train-fp8-rollout", "skipped", "needs 4 processes, 2 available"),
        ("4", "jetrl", "skipped", "needs 4 processes, 2 available"),
        *((("8", m, "invalid", f"stub_train: error: {refused}")) for m in ("bf16", "bf16-train-fp8-rollout", "jetrl")),
    ]
    assert all(r_["steps_total"] == "3" and r_["steps_timed"] == "2" for r_ in rows if r_["status"] == "ok")
    assert float(rows[2]["speedup_step"]) > 1.0  # the stub's FP8 steps are faster
    seen = ranks(out / "sweep_tp2_jetrl")[0]
    assert seen["argv"][:2] == ["run.steps=3", "stub.export=false"]  # user overrides after the sweep's step count
    assert seen["argv"][-4:] == [
        "parallel.tp=2",
        "precision.mode=jetrl",
        "run.name=sweep_tp2_jetrl",
        f"run.out_dir={out / 'sweep_tp2_jetrl'}",
    ]
    assert (out / "sweep_report.md").read_text().startswith("| TP | mode | rollout | status |")
    assert (out / "sweep_tp1_bf16.log").is_file()
    # a user's run.steps wins over --steps; an old run directory is replaced, not resumed
    (out / "sweep_tp1_bf16" / "stale").write_text("old")
    r = run(
        [
            "bash",
            SWEEP,
            "--tp",
            "1",
            "--modes",
            "bf16",
            "--out",
            out,
            "stub.export=false",
            "stub.tensorboard=false",
            "run.steps=2",
        ],
        cwd=tmp_path,
        JETRL_SWEEP_LAUNCH=f"{sys.executable} -m {STUB}",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (out / "sweep_tp1_bf16" / "stale").exists()
    assert len((out / "sweep_tp1_bf16" / "metrics.jsonl").read_text().splitlines()) == 2
    r = run(["bash", SWEEP, "--tp", "0"], cwd=tmp_path)
    assert r.returncode == 2 and "TP size '0' is not a positive integer" in r.stderr
    # a typo every run shares: the config's own message alone, exit 2, before anything is written
    typo = tmp_path / "typo"
    r = run(
        ["bash", SWEEP, "--tp", "1 2", "--modes", "jetrl", "--out", typo, "paralel.tp=2"],
        cwd=tmp_path,
        JETRL_SWEEP_LAUNCH=f"{sys.executable} -m {STUB}",
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "'paralel'" in r.stderr, r.stderr
    assert not typo.exists()


SBATCH = REPO / "launch/slurm/train_grpo.sbatch"


def fake_slurm(tmp_path: Path, **extra) -> dict:
    """A 2-node x 8-GPU allocation as the batch script sees it: SLURM's variables, an `scontrol` that expands the node
    list and an `srun` that records that it was called (a dry run must not call it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[ "$*" = "show hostnames gpu-[01-02]" ] || exit 1\nprintf "gpu-01\\ngpu-02\\n"\n'
    )
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" > {tmp_path / "srun_called"}\nexit 99\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    e = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "JETRL_"))}
    e.update(
        PATH=f"{bin_dir}:{e['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-[01-02]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_ON_NODE="32",
        SLURM_SUBMIT_DIR=str(REPO),
        JETRL_TRAIN_MODULE="megatron_jetrl.rl.train",
        JETRL_DRY_RUN="1",
    )
    e.update(extra)
    return e


def test_sbatch_dry_run_resolves_nodes_ranks_rendezvous_and_command_for_two_nodes(tmp_path):
    """The real config module checks the layout (tiny model at TP 2 x DP 8 = 16 ranks, on this CPU machine); the
    script then prints each node's place in the job and the srun/torchrun command, and starts nothing."""
    args = [
        str(REPO / "configs/tiny.yaml"),
        "parallel.tp=2",
        "parallel.dp=8",
        "grpo.micro_batch_size=8",
        f"run.out_dir={tmp_path / 'run'}",
    ]
    r = subprocess.run(
        ["bash", str(SBATCH), *args], cwd=tmp_path, env=fake_slurm(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.removeprefix("train_grpo.sbatch: dry run: ") for line in r.stdout.splitlines() if "dry run:" in line]
    port = 29500 + 4242
    assert lines[:2] == [
        f"node gpu-01 node_rank=0 nproc_per_node=8 ranks=0-7 rdzv=gpu-01:{port} world_size=16",
        f"node gpu-02 node_rank=1 nproc_per_node=8 ranks=8-15 rdzv=gpu-01:{port} world_size=16",
    ]
    cmd = lines[2].removeprefix("command: ")
    assert cmd.startswith(
        f"srun --nodes=2 --ntasks-per-node=1 --ntasks=2 --cpus-per-task=32 --kill-on-bad-exit=1 "
        f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d "
        f"--rdzv-endpoint=gpu-01:{port} --rdzv-id=jetrl-4242 --no-python bash {REPO}/launch/train_grpo.sh "
    )
    assert (
        subprocess.run(
            ["bash", "-c", f"printf '%s\\n' {cmd.split('train_grpo.sh ', 1)[1]}"], capture_output=True, text=True
        ).stdout.splitlines()
        == args
    )  # the arguments, verbatim after shell quoting
    assert lines[3].startswith("nothing started") and len(lines) == 4
    assert "job 4242, 2 node(s) x 8 process(es) (GPUs per node) = 16" in r.stdout
    assert not (tmp_path / "srun_called").exists() and not (REPO / "runs/.exit/4242").exists()


def test_sbatch_dry_run_keeps_the_world_size_check(tmp_path):
    # DP 1: the config needs 2 ranks where the allocation starts 16
    r = subprocess.run(
        [
            "bash",
            str(SBATCH),
            str(REPO / "configs/tiny.yaml"),
            "parallel.tp=2",
            "parallel.dp=1",
            f"run.out_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=fake_slurm(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "dry run" not in r.stdout, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "train_grpo.sbatch: error: the job would start 16 processes (2 node(s) x 8 from GPUs per node) but the config "
        "needs 2 (parallel.world_size = tp*pp*dp); change the allocation (--nodes, --gpus-per-node, JETRL_NPROC_PER_NODE) "
        "or the parallel sizes (or set JETRL_NO_WORLD_CHECK=1)"
    )
    r = subprocess.run(
        ["bash", str(SBATCH)],
        cwd=tmp_path,
        env=fake_slurm(tmp_path, JETRL_DRY_RUN="yes"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "train_grpo.sbatch: error: JETRL_DRY_RUN must be 1 (print the plan, start nothing) or 0, got 'yes'"
    )
    assert not (tmp_path / "srun_called").exists()


def test_tp_sweep_samples_gpu_memory_into_each_run_and_the_report(tmp_path):
    """On a GPU node (here an `nvidia-smi` stand-in on PATH that prints its samples until it is stopped) each run's
    directory gets gpu_memory.csv, and the report's peak GPU memory column is its largest sample."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/usr/bin/env bash\n[ \"$1\" = -L ] && { echo 'GPU 0: fake'; echo 'GPU 1: fake'; exit 0; }\n"
        "echo '0, 1024'; echo '1, 63488'\nwhile :; do echo '0, 2048'; sleep 0.05; done\n"
    )
    smi.chmod(0o755)
    out = tmp_path / "sweep"
    r = run(
        ["bash", SWEEP, "--tp", "1", "--modes", "bf16", "--out", out, "stub.export=false", "stub.tensorboard=false"],
        cwd=tmp_path,
        JETRL_SWEEP_LAUNCH=f"{sys.executable} -m {STUB}",
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    samples = (out / "sweep_tp1_bf16" / "gpu_memory.csv").read_text().splitlines()
    assert samples[:2] == ["0, 1024", "1, 63488"] and not (out / "sweep_tp1_bf16.gpu_memory.csv").exists()
    row = next(csv.DictReader(open(out / "sweep_report.csv")))
    assert float(row["peak_gpu_gib"]) == 62.0


SHELL_SCRIPTS = sorted(
    {
        *REPO.glob("launch/*.sh"),
        *REPO.glob("launch/slurm/*.sbatch"),
        *REPO.glob("tools/*.sh"),
        *REPO.glob("tools/gpu/*.sh"),
        REPO / ".ci/run",
        REPO / ".ci/slurm.sh",
    }
)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_answers_help_with_its_header_and_runs_nothing(tmp_path, script):
    r = subprocess.run(
        ["bash", str(script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k not in CLEAN},
    )
    assert r.returncode == 0, r.stderr
    header = [ln[2:] for ln in script.read_text().splitlines()[1:4] if ln.startswith("# ")][0]
    assert r.stdout.splitlines()[0] == header and not r.stderr, (r.stdout[:300], r.stderr[:300])
    assert not list(tmp_path.iterdir())  # nothing written where it was called
