"""Faults, bad input and broken engines, tried on real runs (RELIABILITY.md is the table of what is tried here).

Two kinds of test:
* in-process (fast): checkpoints that are half written, corrupt, of another family or layout, refused by the
  resume path; NaN/Inf in `train_step`; malformed rollout engine output through the trainer's `rollout`;
* multi-process (`slow`, about 3-4 minutes together on 2 cores): `launch/train_grpo.sh` on the tiny config, with
  ranks killed (`kill -9`) or frozen (SIGSTOP) mid-step, killed while writing a checkpoint, a full disk (a
  tmpfs in a user namespace), a read-only checkpoint directory, NaN/Inf rewards and gradients, a dying engine.
  Faults are armed with `JETRL_FAULT` by tests/fault_injection.py, a plugin of the trainer's run context
  (`JETRL_PLUGINS=fault_injection:install`): the trainer is rl/train.py itself.

Tests marked xfail(strict=True) are defects found here (RELIABILITY.md, "open defects"): each turns into a
failure (XPASS) once fixed, so that its mark is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gloo import free_port, one_gloo_rank

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "train_grpo.sh"
TINY = REPO / "configs" / "tiny.yaml"
TIMEOUT_S = 10  # run.timeout_s of the runs that measure how long survivors take
SLACK_S = 12  # on top of it: the failure report's 3 s heartbeat wait, exception handling, a loaded 2-core box
RESULTS: dict = {}  # outputs of the multi-process tests, read again by the strict-xfail tests that follow them

INHERITED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "JETRL_FAULT",
    "JETRL_EXIT_DIR",
    "JETRL_NPROC",
    "JETRL_TORCHRUN_ARGS",
    "OMP_NUM_THREADS",
)


# ---- helpers ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def trainer() -> str:
    """The trainer module the runs use (JETRL_FAULT is armed by the fault-injection plugin, `env_for`)."""
    return "megatron_jetrl.rl.train"


def env_for(trainer: str | None = None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env.update(
        PYTHON=sys.executable,
        PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
        OMP_WAIT_POLICY="PASSIVE",
        JETRL_PLUGINS="fault_injection:install",
    )
    if trainer is not None:
        env.update(JETRL_TRAIN_MODULE=trainer, JETRL_CONFIG_MODULE="megatron_jetrl.rl.config")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_args(out: Path, *overrides, steps=2, tp=1, warmup=0, timeout_s=20) -> list[str]:
    return [
        str(TINY),
        f"run.name={out.name}",
        f"run.out_dir={out}",
        f"run.steps={steps}",
        f"warmup.steps={warmup}",
        "run.save_every=1",
        f"parallel.tp={tp}",
        f"run.timeout_s={timeout_s}",
        *overrides,
    ]


def start(trainer, out: Path, *overrides, fault: str | None = None, prefix=(), **kw) -> subprocess.Popen:
    env = env_for(trainer, **({"JETRL_FAULT": fault} if fault else {}))
    return subprocess.Popen(
        [*prefix, "bash", str(LAUNCH), *run_args(out, *overrides, **kw)],
        env=env,
        cwd=out.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
        output, _ = proc.communicate()
        raise AssertionError(f"the run did not end within {timeout} s:\n{output[-4000:]}") from None
    return proc.returncode, output


def launch(trainer, out: Path, *overrides, fault=None, timeout=240, **kw) -> tuple[int, str]:
    return finish(start(trainer, out, *overrides, fault=fault, **kw), timeout)


def wait_for(path: Path, procs, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"a process ended (rc {dead[0].returncode}) before {path} appeared"
        assert time.monotonic() < end, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def rank_pids(out: Path) -> dict[int, int]:
    """{global rank: pid} of the trainer processes (not their bash wrappers) of the run writing to `out`."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            environ = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if f"run.out_dir={out}".encode() in argv and Path(argv[0].decode()).name.startswith("python") and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(d.name)
    return found


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def metrics(out: Path) -> dict[int, dict]:
    path = out / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def comparable(row: dict) -> dict:
    """A metrics line without its wall-clock keys."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/")) and k not in ("sync/seconds", "sync/GBps")}


def latest(out: Path) -> Path | None:
    from megatron_jetrl.rl.run_state import STATE_FILE

    done = sorted(
        p
        for p in (out / "checkpoints").glob("step_*")
        if p.is_dir() and not p.name.endswith(".partial") and (p / STATE_FILE).is_file()
    )
    return done[-1] if done else None


def assert_intact(ckpt: Path) -> None:
    from megatron_jetrl.models.shards import ShardedCheckpoint

    ShardedCheckpoint.open(ckpt, verify=True)
    if (ckpt / "ref").is_dir():
        ShardedCheckpoint.open(ckpt / "ref", verify=True)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == int(ckpt.name.split("_")[1])


def shards_equal(a: Path, b: Path) -> bool:
    return sorted(p.name for p in a.glob("tp*.safetensors")) == sorted(p.name for p in b.glob("tp*.safetensors")) and all(
        (a / p.name).read_bytes() == (b / p.name).read_bytes() for p in a.glob("tp*.safetensors")
    )


def jetrl_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "jetrl: rank" in line and " failed" in line]
    assert lines, f"no failure report line in:\n{output[-3000:]}"
    return lines[0]


def start_ranks(trainer: str, out: Path, *overrides, world=2, fault=None, **kw) -> list[subprocess.Popen]:
    """The ranks of a run started by hand, without torchrun (as on a node whose peers are on other hosts):
    nobody tears the survivors down but their own collective timeout."""
    port = free_port()
    procs = []
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = env_for(
            None,
            RANK=rank,
            LOCAL_RANK=rank,
            WORLD_SIZE=world,
            LOCAL_WORLD_SIZE=world,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS=1,
            **({"JETRL_FAULT": fault} if fault else {}),
        )
        log = open(out.parent / f"{out.name}.rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", trainer, *run_args(out, *overrides, **kw)],
                env=env,
                cwd=out.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs


def rank_log(out: Path, rank: int) -> str:
    return (out.parent / f"{out.name}.rank{rank}.log").read_text()


# ---- multi-process: the reference run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(trainer, tmp_path_factory) -> Path:
    """An uninterrupted TP2 run: 2 GRPO steps after a 5-step warm-start, a checkpoint after each step."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    rc, output = launch(trainer, out, tp=2, warmup=5)
    assert rc == 0, output[-4000:]
    assert sorted(metrics(out)) == [0, 1]
    return out


@pytest.fixture(scope="module")
def reference_pp(trainer, tmp_path_factory) -> Path:
    """The same run with two pipeline stages (PP 2) instead of TP 2."""
    out = tmp_path_factory.mktemp("ref_pp") / "ref_pp"
    rc, output = launch(trainer, out, "parallel.pp=2", warmup=5, steps=3)
    assert rc == 0, output[-4000:]
    assert sorted(metrics(out)) == [0, 1, 2]
    return out


def assert_resumes_exactly(trainer, out: Path, reference: Path, from_step: int, *overrides, tp=2, steps=2) -> None:
    """Resume `out` with the reference's arguments: it continues from `from_step` and every metrics line equals
    the uninterrupted run's (wall-clock keys aside)."""
    rc, output = launch(trainer, out, *overrides, tp=tp, warmup=5, steps=steps)
    assert rc == 0, output[-4000:]
    assert f"GRPO jetrl: 1/{steps - from_step} steps" in output  # it continued; it did not start over
    ours, theirs = metrics(out), metrics(reference)
    assert sorted(ours) == sorted(theirs) == list(range(steps))
    for step in range(steps):  # the steps before the fault and the ones after the resume
        assert comparable(ours[step]) == comparable(theirs[step]), step
    assert_intact(latest(out))
    assert latest(out).name == f"step_{steps:06d}" and not list((out / "checkpoints").glob("*.partial"))


# ---- multi-process: interrupts ----------------------------------------------------------------------------


def interrupt_when_stepping(proc, out: Path, *signals, after_lines=1) -> None:
    """The launcher gets `signals` (0.2 s apart) once `after_lines` GRPO steps are in metrics.jsonl."""
    end = time.monotonic() + 180
    while len(metrics(out)) < after_lines:
        assert proc.poll() is None and time.monotonic() < end, "the run ended or stalled before it was interrupted"
        time.sleep(0.05)
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.2)


@pytest.mark.slow
def test_ctrl_c_stops_at_the_end_of_the_step_with_a_checkpoint_one_line_and_exit_130_then_resumes(trainer, tmp_path):
    out = tmp_path / "ctrl_c"
    proc = start(trainer, out, "run.save_every=0", tp=2, warmup=2, steps=30)  # a checkpoint at the end only: none yet
    interrupt_when_stepping(proc, out, signal.SIGINT)
    rc, output = finish(proc, timeout=120)
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    stopped = int(re.search(r"stopped at the end of GRPO step (\d+)", last).group(1))
    assert last == (
        f"train_grpo.sh: interrupted (SIGINT): stopped at the end of GRPO step {stopped}; checkpoint "
        f"{out}/checkpoints/step_{stopped + 1:06d}: a restart resumes at step {stopped + 1} of 30; resume: bash "
        f"{LAUNCH} {' '.join(run_args(out, 'run.save_every=0', tp=2, warmup=2, steps=30))}"
    ), last
    assert sorted(metrics(out)) == list(range(stopped + 1)) and latest(out).name == f"step_{stopped + 1:06d}"
    assert_intact(latest(out))
    assert not (out / "run.lock").exists()
    rc, output = launch(trainer, out, "run.save_every=0", tp=2, warmup=2, steps=stopped + 2)
    assert rc == 0 and f"resuming {out} at step {stopped + 1} of {stopped + 2}" in output, output[-3000:]
    assert sorted(metrics(out)) == list(range(stopped + 2))


@pytest.mark.slow
def test_ctrl_c_reaching_one_rank_mid_step_stops_both_after_it_and_the_resume_is_exact(trainer, reference, tmp_path):
    """SIGINT to rank 1 alone during step 0's update (TP 2): both ranks stop at the end of step 0 (they agree on it),
    the launcher says so and exits 130, and the resumed run's metrics equal the uninterrupted run's."""
    out = tmp_path / "int_rank1"
    rc, output = launch(trainer, out, tp=2, warmup=5, fault="int@update:step=0:rank=1", timeout=180)
    assert rc == 130 and "Traceback" not in output, output[-3000:]
    assert f"interrupted (SIGINT): stopped at the end of GRPO step 0; checkpoint {out}/checkpoints/step_000001" in output
    assert sorted(metrics(out)) == [0]
    assert_resumes_exactly(trainer, out, reference, from_step=1)


@pytest.mark.slow
def test_sigterm_stops_the_same_way_with_exit_143_and_a_second_ctrl_c_stops_at_once(trainer, tmp_path):
    out = tmp_path / "term"
    proc = start(trainer, out, warmup=2, steps=30)
    interrupt_when_stepping(proc, out, signal.SIGTERM)
    rc, output = finish(proc, timeout=120)
    assert rc == 143 and "Traceback" not in output, output[-3000:]
    assert re.search(r"train_grpo.sh: interrupted \(SIGTERM\): stopped at the end of GRPO step \d+; checkpoint ", output)
    out = tmp_path / "twice"
    proc = start(trainer, out, "run.save_every=0", warmup=2, steps=30)
    interrupt_when_stepping(proc, out, signal.SIGINT, signal.SIGINT)
    rc, output = finish(proc, timeout=60)
    assert rc == 130 and "Traceback" not in output, output[-3000:]
    assert re.search(
        r"train_grpo.sh: interrupted \(SIGINT\): stopped at once during GRPO step \d+: nothing saved since the "
        r"newest checkpoint, where a restart resumes; resume: bash ",
        output,
    ), output[-2000:]
    assert latest(out) is None  # save_every=0: nothing was saved


# ---- multi-process: a rank dies or freezes ----------------------------------------------------------------


@pytest.mark.slow
def test_kill9_of_one_rank_mid_step_under_torchrun_then_exact_resume(trainer, reference, tmp_path):
    out = tmp_path / "killed"
    proc = start(trainer, out, tp=2, warmup=5)
    wait_for(out / "checkpoints" / "step_000001" / "trainer_state.json", [proc])
    time.sleep(0.3)  # into step 1: rollout / logprobs / update
    pids = rank_pids(out)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rc, output = finish(proc, timeout=120)
    took = time.monotonic() - killed
    RESULTS["kill9_torchrun_s"] = took
    print(f"kill -9 rank 1 under torchrun: launcher exited {took:.1f} s later, rc {rc}")
    assert rc == 137, output[-3000:]  # the lost rank's code (128 + SIGKILL), not torchrun's 1
    assert re.search(
        r"Root Cause \(first observed failure\):\n\[0\]:\n.*\n.*\n\s+rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: 137", output
    ), output[-3000:]
    assert (
        "train_grpo.sh: the run failed with exit code 137 (torchrun: 1): rank 1 failed first (exit code 137, SIGKILL)" in output
    )
    assert took < 30, f"the survivors took {took:.1f} s to stop"
    assert latest(out).name == "step_000001"
    assert_intact(latest(out))
    assert sorted(metrics(out)) == [0]
    assert_resumes_exactly(trainer, out, reference, from_step=1)


@pytest.mark.slow
def test_kill9_of_a_pipeline_stage_names_rank_stage_and_step_then_exact_resume(trainer, reference_pp, tmp_path):
    """PP 2: rank 1 holds the second pipeline stage (the layers after the first half, the loss). Killed mid-step, the
    survivor's line names itself and the lost rank with their stages and the step; the run resumes from its last
    checkpoint and ends where the uninterrupted PP 2 run does."""
    out = tmp_path / "killed_pp"
    proc = start(trainer, out, "parallel.pp=2", warmup=5, steps=3)
    wait_for(out / "checkpoints" / "step_000001" / "trainer_state.json", [proc])
    pids = rank_pids(out)
    assert sorted(pids) == [0, 1], pids
    environ = dict(x.split(b"=", 1) for x in Path(f"/proc/{pids[1]}/environ").read_bytes().split(b"\0") if b"=" in x)
    where = Path(environ[b"JETRL_EXIT_DIR"].decode(), "rank1.where")  # the heartbeat's record of rank 1's position
    end = time.monotonic() + 60
    while not (where.exists() and where.read_text().startswith("at step 1 ")):
        assert time.monotonic() < end and proc.poll() is None, "rank 1 never reported being in step 1"
        time.sleep(0.05)
    os.kill(pids[1], signal.SIGKILL)
    rc, output = finish(proc, timeout=120)
    assert rc == 137, output[-3000:]
    assert re.search(
        r"train_grpo.sh: the run failed with exit code 137 \(torchrun: 1\): rank 1 failed first \(exit code 137, "
        r"SIGKILL\) at step 1 \(\w+\), pipeline stage 1 of 2",
        output,
    ), output[-3000:]
    assert latest(out).name == "step_000001" and sorted(metrics(out)) == [0]
    assert_resumes_exactly(trainer, out, reference_pp, 1, "parallel.pp=2", tp=1, steps=3)


@pytest.mark.slow
def test_kill9_during_a_checkpoint_write_resumes_the_previous_one(trainer, reference, tmp_path):
    out = tmp_path / "killed_in_save"
    rc, output = launch(trainer, out, tp=2, warmup=5, fault="kill@save:step=2:rank=0")
    assert rc == 137, output[-3000:]
    partial = out / "checkpoints" / "step_000002.partial"
    assert (partial / "tp00_pp000.safetensors").is_file() and (partial / "meta.json").is_file()
    assert not (partial / "trainer_state.json").exists() and not (out / "checkpoints" / "step_000002").exists()
    assert latest(out).name == "step_000001"  # the half-written one is never picked up
    assert_intact(latest(out))
    assert_resumes_exactly(trainer, out, reference, from_step=1)


LOST = {
    "killed": (None, True),
    "frozen while rank 0 waits in the rollout broadcast (default group)": ("stop@rollout:step=1:rank=1", False),
    "frozen while rank 0 waits in a TP all-reduce of the backward (megatron's TP group)": ("stop@update:step=1:rank=1", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOST))
def test_survivor_stops_within_the_timeout_naming_the_lost_rank(trainer, tmp_path, case, request):
    """Ranks started by hand (no torchrun to tear them down): rank 1 is killed or frozen at step 1; rank 0 must
    stop within run.timeout_s (+ slack) with a line naming the step and the lost rank."""
    fault, external_kill = LOST[case]
    out = tmp_path / "lost"
    procs = start_ranks(trainer, out, tp=2, fault=fault, timeout_s=TIMEOUT_S)
    try:
        wait_for(out / "checkpoints" / "step_000001" / "trainer_state.json", procs)
        if external_kill:
            time.sleep(0.3)
            procs[1].send_signal(signal.SIGKILL)
        else:
            end = time.monotonic() + 60
            while not stopped(procs[1].pid):
                assert time.monotonic() < end and procs[1].poll() is None, rank_log(out, 1)[-2000:]
                time.sleep(0.02)
        lost_at, reported_at = time.monotonic(), None
        while (rc := procs[0].poll()) is None:
            if time.monotonic() - lost_at > TIMEOUT_S + SLACK_S:
                pytest.fail(
                    f"rank 0 still runs {TIMEOUT_S + SLACK_S} s after rank 1 was lost (run.timeout_s={TIMEOUT_S}):\n"
                    + rank_log(out, 0)[-1500:]
                )
            if reported_at is None and "jetrl: rank 0 failed" in rank_log(out, 0):
                reported_at = time.monotonic()
            time.sleep(0.05)
        took = time.monotonic() - lost_at
        RESULTS[f"lost:{case}"] = took
        log = rank_log(out, 0)
        if reported_at is None and "jetrl: rank 0 failed" in log:  # reported and gone within the last poll
            reported_at = time.monotonic()
        assert rc == 1
        line = jetrl_line(log)
        lingered = time.monotonic() - (reported_at or lost_at)
        print(
            f"{case}: rank 0 exited {took:.1f} s after rank 1 was lost (run.timeout_s={TIMEOUT_S}), rc {rc}, "
            f"{lingered:.2f} s after its report\n  {line}"
        )
        # it leaves right after its report (fixed, was D15: interpreter shutdown then waited 1.4-7 s, once > 9 s,
        # on the destructors of the broken process group)
        assert reported_at is not None and lingered < 1.0, lingered
        assert "rank 0 failed at step 1" in line and "lost rank(s) [1]" in line, line
        assert "newest complete checkpoint: " in line and line.rstrip().endswith("(a restart resumes there)")
        assert latest(out).name == "step_000001"
        assert_intact(latest(out))
    finally:
        for p in procs:  # the ranks this test started
            if p.poll() is None:
                p.kill()
            p.wait()


# ---- multi-process: the output path -----------------------------------------------------------------------


def _can_unshare(*flags: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(trainer, tmp_path):
    """A tmpfs (in a user + mount namespace) filled up once step_000001 is saved: step 2's save fails."""
    if not (_can_unshare("--user", "--map-root-user", "--mount") and shutil.which("fallocate")):
        pytest.skip("needs unshare --user --map-root-user --mount (user namespaces) and fallocate")
    mnt, copy = tmp_path / "mnt", tmp_path / "copy"
    mnt.mkdir()
    out = mnt / "run"
    cmd = " ".join(["bash", str(LAUNCH), *map(shlex_quote, run_args(out, steps=3))])
    script = f"""
set -u
mount -t tmpfs -o size=512m tmpfs {mnt} || exit 90
( {cmd} > {tmp_path}/log 2>&1; echo $? > {tmp_path}/rc ) &
while [ ! -f {out}/checkpoints/step_000001/trainer_state.json ]; do
  [ -f {tmp_path}/rc ] && break; sleep 0.05
done
free_kb=$(df -k --output=avail {mnt} | tail -n 1)
fallocate -l $(( (free_kb - 2048) * 1024 )) {mnt}/filler
wait
df -k {mnt} > {tmp_path}/df
cp -a {out} {copy}
"""
    r = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script],
        env=env_for(trainer),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode == 90:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr}")
    assert r.returncode == 0, r.stderr
    rc, output = int((tmp_path / "rc").read_text()), (tmp_path / "log").read_text()
    RESULTS["disk_full"] = output
    assert rc == 1, output[-3000:]
    line = jetrl_line(output)
    print(line)
    assert "rank 0 failed at step 1 (save)" in line, line
    assert "MiB free (out of space)" in line, line  # the report names the free space of the run directory's filesystem
    assert latest(copy).name == "step_000001"
    assert_intact(latest(copy))
    assert sorted(metrics(copy)) == [0, 1]  # nothing lost: both steps' metrics are on disk


def test_disk_full_error_itself_names_the_cause_and_the_file():
    output = RESULTS.get("disk_full") or pytest.skip("test_disk_full_during_a_checkpoint_keeps_the_previous_one did not run")
    errors = [line for line in output.splitlines() if "Error" in line and "jetrl:" not in line]
    print("\n".join(errors))
    assert any("No space left on device" in line and re.search(r"step_000002.partial/\S+", line) for line in errors), errors


@pytest.mark.slow
def test_read_only_checkpoint_directory_is_refused_before_the_first_step(trainer, tmp_path):
    prefix = ()
    if os.geteuid() == 0:  # root ignores file modes; an unmapped user namespace does not
        if not _can_unshare("--user"):
            pytest.skip("running as root without user namespaces: cannot take write permission away")
        prefix = ("unshare", "--user")
    out = tmp_path / "ro"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints").chmod(0o555)
    try:
        rc, output = launch(trainer, out, prefix=prefix)
    finally:
        (out / "checkpoints").chmod(0o755)
    assert rc == 2, output[-3000:]
    assert f"config error: cannot write checkpoints to {out}/checkpoints ([Errno 13] Permission denied" in output
    assert "make it writable or set run.out_dir" in output
    assert "GRPO jetrl: 1/2" not in output and not (out / "metrics.jsonl").exists()  # no step was computed, then lost
    assert "rank 0 failed first (exit code 2)" in output


# ---- multi-process: NaN/Inf -------------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_reward_stops_the_run_before_the_update(trainer, tmp_path):
    out = tmp_path / "nan"
    rc, output = launch(trainer, out, fault="nan@reward:step=1")  # run.on_nonfinite=stop, jetrl
    RESULTS["nan_stop"] = output
    assert rc == 1, output[-3000:]
    line = jetrl_line(output)
    print(line)
    assert "rank 0 failed at step 1 (update)" in line and "nan" in line, line
    assert sorted(metrics(out)) == [0] and latest(out).name == "step_000001"  # no update was applied or saved
    assert_intact(latest(out))


def test_a_fault_before_a_sync_fires_at_its_own_step(trainer, tmp_path):
    """The sync opens each step (the engines then serve the policy that step samples): `raise@sync:step=1` fires
    after step 0 was written and saved, before anything of step 1, and the line names step 1."""
    out = tmp_path / "sync"
    rc, output = launch(trainer, out, fault="raise@sync:step=1")
    assert rc == 1, output[-3000:]
    line = jetrl_line(output)
    assert "rank 0 failed at step 1" in line and "before sync at step 1" in line, line
    assert sorted(metrics(out)) == [0] and latest(out).name == "step_000001"
    assert_intact(latest(out))


def test_nan_reward_is_named_as_the_reward():
    output = RESULTS.get("nan_stop") or pytest.skip("test_nan_reward_stops_the_run_before_the_update did not run")
    assert "NonFiniteError: step 1: non-finite reward nan of completion 0 (prompt 0, sample 0;" in jetrl_line(output)


@pytest.mark.slow
def test_inf_gradient_skips_the_step_when_asked(trainer, tmp_path):
    """bf16 (fast on CPU; FP8 skips the same way: test_train_step_skip_under_fp8, test_update_policy_on_nonfinite):
    step 1's gradients are inf, its update is skipped (the weights after it equal those before), step 2 trains again."""
    out = tmp_path / "skip"
    rc, output = launch(
        trainer,
        out,
        "run.on_nonfinite=skip",
        "precision.mode=bf16",
        "model.batch_invariant=false",
        steps=3,
        warmup=5,
        fault="inf@grad:step=1",
    )  # batch-invariant BF16 runs 15 s/step on CPU, the default path 0.3 s
    RESULTS["skip"] = output
    assert rc == 0, output[-3000:]
    rows = metrics(out)
    assert [rows[s]["skipped_updates"] for s in (0, 1, 2)] == [0, 1, 0]
    assert rows[1]["grad_norm"] is None and rows[0]["grad_norm"] and rows[2]["grad_norm"]
    assert rows[1]["skipped"].startswith("rank 0: NaN/Inf in the gradients of [") and rows[0]["skipped"] is None
    ck = out / "checkpoints"
    assert shards_equal(ck / "step_000001", ck / "step_000002")  # the skipped step changed nothing
    assert not shards_equal(ck / "step_000002", ck / "step_000003")  # the next one trained


def test_skipped_update_is_reported_with_step_rank_and_tensor():
    output = RESULTS.get("skip") or pytest.skip("test_inf_gradient_skips_the_step_when_asked did not run")
    assert re.search(r"step 1.*skip.*rank 0.*(grad|weight)", output, re.I)


# ---- multi-process: the rollout engine dies ---------------------------------------------------------------


@pytest.mark.slow
def test_rollout_engine_death_is_a_clear_error_and_leaves_the_trainer_state(trainer, tmp_path):
    out = tmp_path / "engine"
    rc, output = launch(trainer, out, fault="die@engine:step=1")
    assert rc == 1, output[-3000:]
    assert "InjectedFault: the rollout engine died" in output
    print(jetrl_line(output))
    assert "rank 0 failed at step 1 (rollout)" in jetrl_line(output)
    assert sorted(metrics(out)) == [0] and latest(out).name == "step_000001"
    assert_intact(latest(out))


# ---- in-process: checkpoints on disk ----------------------------------------------------------------------


def _cfg(out: Path, *overrides):
    from megatron_jetrl.rl.config import load_config

    return load_config(None, [f"run.out_dir={out}", *overrides])


def test_half_written_checkpoints_are_never_picked_up(tmp_path):
    from megatron_jetrl.rl.checkpoints import latest_checkpoint
    from megatron_jetrl.rl.run_state import STATE_FILE

    cfg = _cfg(tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    for name, files in {
        "step_000002": ["meta.json", "tp00_pp000.safetensors", STATE_FILE],  # complete
        "step_000003.partial": ["meta.json", "tp00_pp000.safetensors", STATE_FILE],  # staged, never renamed
        "step_000004": ["meta.json", "tp00_pp000.safetensors"],  # no trainer_state.json: not complete
        "step_000005.partial": ["tp00_pp000.safetensors"],  # killed mid-shard
    }.items():
        (root / name).mkdir(parents=True)
        for f in files:
            (root / name / f).write_text("{}")
    (root / "step_000006").write_text("not a directory")
    assert latest_checkpoint(cfg) == root / "step_000002"


@pytest.fixture(scope="module")
def one_rank():
    """torch.distributed + megatron parallel state, one gloo rank in this process."""
    yield from one_gloo_rank()


def _actor(cfg, mode: str = "jetrl"):
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.actor.train_step import wrap_for_training
    from megatron_jetrl.fp8 import PrecisionFlow

    flow = PrecisionFlow(mode=mode, backend="emulated") if mode != "bf16" else PrecisionFlow(mode="bf16")
    torch.manual_seed(0)
    release = "release" if mode == "jetrl" and cfg.bf16_linears_released() else "keep"  # the run's default in jetrl
    model = build_model(cfg.arch(), flow, ActorOptions(params_dtype=torch.bfloat16, bf16_linear_weights=release))
    ddp, optimizer = wrap_for_training(model, cfg.optim)
    return ddp, optimizer, flow


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    """A tiny actor with its optimizer, saved as checkpoints/step_000001 the way checkpoints.save does it."""
    from megatron_jetrl.actor.checkpoint import save_checkpoint
    from megatron_jetrl.rl.run_state import STATE_FILE

    out = tmp_path_factory.mktemp("saved") / "run"
    cfg = _cfg(out, "loss.kl_coef=0")
    ddp, optimizer, flow = _actor(cfg)
    ck = out / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    save_checkpoint(ddp, ck, hf_config=cfg.model.architecture(), flow=flow, iteration=1, optimizer=optimizer)
    (ck / STATE_FILE).write_text(json.dumps({"step": 1, "warmup_done": True, "sampler": None, "config": cfg.to_dict()}))
    return SimpleNamespace(out=out, ck=ck, cfg=cfg, ddp=ddp, optimizer=optimizer)


def _resume(saved, tmp_path, damage, *overrides):
    """Copy the saved run, damage it, and resume it the way the trainer does (checkpoints.resume)."""
    from megatron_jetrl.rl import checkpoints

    out = tmp_path / "run"
    shutil.copytree(saved.out, out)
    damage(out / "checkpoints" / "step_000001")
    cfg = _cfg(out, "loss.kl_coef=0", *overrides)
    s = SimpleNamespace(
        cfg=cfg,
        model=saved.ddp,
        optimizer=saved.optimizer,
        reference=None,
        sampler=SimpleNamespace(load_state_dict=lambda state: None),
        kv_scales=None,
    )
    return checkpoints.resume(s)


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def test_resume_of_an_intact_checkpoint(saved, tmp_path):
    assert _resume(saved, tmp_path, lambda ck: None)["step"] == 1


def _newer(out: Path, step: int = 2) -> Path:
    """A copy of step_000001 as a newer checkpoint (its trainer state at `step`)."""
    from megatron_jetrl.rl.run_state import STATE_FILE

    newer = out / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(out / "checkpoints" / "step_000001", newer)
    _edit_json(newer / STATE_FILE, step=step)
    return newer


@pytest.mark.parametrize(
    "damage,why",
    [
        (
            lambda ck: os.truncate(ck / "tp00_pp000.safetensors", 1000),
            r"step_000002/tp00_pp000.safetensors is 1000 bytes, its manifest says \d+",
        ),
        (lambda ck: (ck / "optim_tp00_pp000.pt").unlink(), r"step_000002/optim_tp00_pp000.pt is missing"),
        (lambda ck: (ck / "trainer_state.json").write_text('{"step": 2, "warm'), r"unreadable manifest \(JSONDecodeError"),
    ],
    ids=["truncated shard", "deleted optimizer state", "damaged trainer state"],
)
def test_resume_falls_back_past_a_damaged_newest_checkpoint_and_keeps_it_aside(saved, tmp_path, capsys, damage, why):
    from megatron_jetrl.rl import checkpoints
    from megatron_jetrl.rl.run_state import previous_run

    out = tmp_path / "run"
    shutil.copytree(saved.out, out)
    damage(_newer(out))
    (out / "summary.json").write_text("{}")  # the run had finished at step 2: its final checkpoint is checked first
    cfg = _cfg(out, "loss.kl_coef=0", "run.steps=2")
    previous = previous_run(cfg)
    assert previous.step == 1 and not previous.complete(cfg)
    s = SimpleNamespace(
        cfg=cfg,
        model=saved.ddp,
        optimizer=saved.optimizer,
        reference=None,
        sampler=SimpleNamespace(load_state_dict=lambda state: None),
        kv_scales=None,
    )
    assert checkpoints.resume(s)["step"] == 1
    err = capsys.readouterr().err
    assert re.search(
        rf"note: skipped the damaged checkpoint step_000002 \({why}.*\); kept aside as "
        rf"{out}/checkpoints/step_000002.damaged, resuming from step_000001",
        err,
    ), err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002.damaged"]
    assert checkpoints.latest_checkpoint(cfg) == out / "checkpoints" / "step_000001"


def test_a_finished_run_with_a_sound_final_checkpoint_is_complete(saved, tmp_path):
    from megatron_jetrl.rl.run_state import previous_run

    out = tmp_path / "run"
    shutil.copytree(saved.out, out)
    _newer(out)
    (out / "summary.json").write_text("{}")
    cfg = _cfg(out, "loss.kl_coef=0", "run.steps=2")
    assert previous_run(cfg).complete(cfg)


CORRUPT = {
    "bit-flipped shard": (
        lambda ck: _flip(ck / "tp00_pp000.safetensors"),
        r"tp00_pp000.safetensors: sha256 differs from the manifest \(corrupt shard\)",
    ),
    "truncated shard": (
        lambda ck: os.truncate(ck / "tp00_pp000.safetensors", 1000),
        r"tp00_pp000.safetensors: 1000 bytes, the manifest says \d+ \(truncated or replaced\)",
    ),
    "missing shard": (lambda ck: (ck / "tp00_pp000.safetensors").unlink(), r"shard tp00_pp000.safetensors is missing"),
    "no meta.json": (lambda ck: (ck / "meta.json").unlink(), r"step_000001 has no meta.json: .* save did not finish"),
    "another parallel layout": (
        lambda ck: _edit_json(ck / "meta.json", tp=2),
        r"step_000001 was saved at TP=2 x PP=1; this run is TP=1 x PP=1 \(reshard with the converter\)",
    ),
    "another pipeline split": (
        lambda ck: _edit_json(ck / "meta.json", pp_last_layers=1),
        r"step_000001 was saved with parallel.pp_last_layers=1; this run has 0: resume with the split it was saved with",
    ),
    "optimizer state without a sha256 (an older checkpoint)": (
        lambda ck: _edit_json(ck / "meta.json", optimizer=True),
        r"step_000001/meta.json has no sha256 of optim_tp00_pp000.pt",
    ),
}


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("case", list(CORRUPT))
def test_damaged_checkpoint_is_refused_saying_what_and_where(saved, tmp_path, case):
    from megatron_jetrl.models.shards import CheckpointError

    damage, message = CORRUPT[case]
    with pytest.raises(CheckpointError, match=message) as e:
        _resume(saved, tmp_path, damage)
    assert str(tmp_path / "run" / "checkpoints" / "step_000001") in str(e.value)


def test_checkpoint_of_another_model_family_is_refused(saved, tmp_path):
    from megatron_jetrl.rl.config import ConfigError

    llama = (
        "model.hf_config={model_type: llama, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, "
        "num_attention_heads: 2, num_key_value_heads: 2, head_dim: 128, vocab_size: 256, tie_word_embeddings: true}"
    )
    with pytest.raises(ConfigError, match=r"step_000001 was written by a run with another model or precision section"):
        _resume(saved, tmp_path, lambda ck: None, llama)
    with pytest.raises(ConfigError, match=r"another model or precision section"):
        _resume(saved, tmp_path / "p", lambda ck: None, "precision.mode=bf16")


def test_bit_flipped_optimizer_state_is_refused(saved, tmp_path):
    from megatron_jetrl.models.shards import CheckpointError

    with pytest.raises(
        CheckpointError,
        match=r"optim_tp00_pp000.pt: sha256 differs from the manifest \(corrupt optimizer state\); "
        r"if it is damaged, move .*step_000001 out of",
    ):
        _resume(saved, tmp_path, lambda ck: _flip(ck / "optim_tp00_pp000.pt", 0.7))


@pytest.mark.parametrize("damage", ['{"step": 1, "warm', '{"step": 7, "sampler": null, "config": {}}'])
def test_damaged_trainer_state_is_refused_naming_the_file(saved, tmp_path, damage):
    from megatron_jetrl.models.shards import CheckpointError

    with pytest.raises(
        CheckpointError,
        match=r"step_000001/trainer_state.json is damaged \(.*\): move "
        r".*step_000001 out of .*checkpoints and restart: the run resumes from the checkpoint before it",
    ):
        _resume(saved, tmp_path, lambda ck: (ck / "trainer_state.json").write_text(damage))


def test_a_full_disk_names_the_file_being_written(saved, tmp_path):
    """The optimizer file lands on /dev/full (a symlink): ENOSPC, named with the file and the free space."""
    from megatron_jetrl.actor.checkpoint import save_checkpoint
    from megatron_jetrl.models.shards import CheckpointWriteError

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    (tmp_path / "optim_tp00_pp000.pt").symlink_to("/dev/full")
    with pytest.raises(
        CheckpointWriteError,
        match=rf"writing {tmp_path}/optim_tp00_pp000.pt failed: OSError: \[Errno 28\] No space "
        rf"left on device; [0-9.]+ MiB free on {tmp_path}: free space there",
    ):
        save_checkpoint(
            saved.ddp,
            tmp_path,
            hf_config=saved.cfg.model.architecture(),
            flow=saved.cfg.precision,
            iteration=1,
            optimizer=saved.optimizer,
        )


def test_checkpoint_directory_is_checked_before_the_first_step(one_rank, tmp_path, monkeypatch):
    from megatron_jetrl.rl import checkpoints
    from megatron_jetrl.rl.config import ConfigError

    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "checkpoints").write_text("a file where the directory goes")
    with pytest.raises(
        ConfigError, match=r"cannot write checkpoints to .*blocked/checkpoints \(.*\): make it writable or set run.out_dir"
    ):
        checkpoints.check_output_space(_cfg(tmp_path / "blocked"))
    ck = tmp_path / "full" / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text("{}")
    (ck / "tp00_pp000.safetensors").write_bytes(bytes(3 << 20))
    checkpoints.check_output_space(_cfg(tmp_path / "full"))
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    with pytest.raises(
        ConfigError, match=r"checkpoints has 1.0 MiB free but a checkpoint takes 3.0 MiB \(step_000001\): free space"
    ):
        checkpoints.check_output_space(_cfg(tmp_path / "full"))


# ---- in-process: NaN/Inf in train_step --------------------------------------------------------------------


def _tokens(cfg, batch=4, seq=12):
    return torch.randint(3, cfg.arch().vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def _loss(poison: str | None):
    from fault_injection import PoisonGrad

    def loss_fn(logprobs, extras):
        if poison == "grad":
            logprobs = PoisonGrad.apply(logprobs, float("inf"))
        loss = -logprobs.mean()
        return (loss * float("nan") if poison == "loss" else loss), {"kl": logprobs.detach().mean() * 0}

    return loss_fn


def _params(ddp) -> dict:
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize(
    "poison, on_nonfinite, message",
    [
        (
            "loss",
            "raise",
            r"rank 0: NaN/Inf in \['loss'\] from the loss callback and in the gradients of .*the optimizer step was not taken",
        ),
        ("grad", "raise", r"rank 0: NaN/Inf in the gradients of \['embedding.word_embeddings.weight'"),
        ("loss", "skip", r"rank 0: NaN/Inf in \['loss'\]"),
    ],
)
def test_train_step_never_updates_on_nan_inf(one_rank, tmp_path, poison, on_nonfinite, message):
    """BF16 actor: NaN loss or Inf gradient (finite loss) -> NonFiniteError naming rank and tensor, or a skip;
    either way the weights are untouched."""
    from megatron_jetrl.actor.train_step import NonFiniteError, train_step

    cfg = _cfg(tmp_path / "r", "precision.mode=bf16")
    ddp, optimizer, _ = _actor(cfg, "bf16")
    before = _params(ddp)
    step = dict(vocab_size=cfg.arch().vocab_size, micro_batch_size=2, on_nonfinite=on_nonfinite)
    if on_nonfinite == "raise":
        with pytest.raises(NonFiniteError, match=message):
            train_step(ddp, optimizer, _tokens(cfg), _loss(poison), **step)
    else:
        out = train_step(ddp, optimizer, _tokens(cfg), _loss(poison), **step)
        assert out["ok"] is False and re.search(message, out["skipped"])
    assert all(torch.equal(before[n], p) for n, p in _params(ddp).items())
    assert train_step(ddp, optimizer, _tokens(cfg), _loss(None), **step)["ok"]  # and it trains on afterwards
    assert not all(torch.equal(before[n], p) for n, p in _params(ddp).items())


def test_finite_check_reads_gradients_once_and_clears_an_overflowing_norm(one_rank):
    """train_step's check reads every gradient once (its L1 norm). Finite gradients whose L1 norm overflows FP32 take
    the exact look, which finds nothing and lets the step go on; a NaN is named."""
    from megatron_jetrl.actor import train_step as ts
    from megatron_jetrl.fp8 import finite

    model = SimpleNamespace(module=torch.nn.Module())
    model.module.w = torch.nn.Parameter(torch.zeros(4096))
    model.module.w.main_grad = torch.full((4096,), 3e35)  # finite; its L1 norm (1.2e39) is not
    assert not torch.isfinite(torch.stack(torch._foreach_norm([model.module.w.main_grad], 1))).all()
    with finite.watch() as watch:
        assert ts._check_finite(model, [{"loss": torch.tensor(1.0)}], "raise", watch) is None
    model.module.w.main_grad[7] = float("nan")
    with finite.watch() as watch, pytest.raises(ts.NonFiniteError, match=r"rank 0: NaN/Inf in the gradients of \['w'\]"):
        ts._check_finite(model, [{"loss": torch.tensor(1.0)}], "raise", watch)


def test_train_step_stops_on_nan_under_fp8(one_rank, tmp_path):
    """jetrl: the FP8 backward quantizes the NaN gradient without refusing it; train_step's check names it."""
    from megatron_jetrl.actor.train_step import NonFiniteError, train_step

    cfg = _cfg(tmp_path / "r")
    ddp, optimizer, _ = _actor(cfg)
    before = _params(ddp)
    with pytest.raises(NonFiniteError, match=r"rank 0: NaN/Inf in \['loss'\] from the loss callback and in the gradients of \["):
        train_step(
            ddp,
            optimizer,
            _tokens(cfg),
            _loss("loss"),
            vocab_size=cfg.arch().vocab_size,
            micro_batch_size=2,
            on_nonfinite="raise",
        )
    assert all(torch.equal(before[n], p) for n, p in _params(ddp).items())


def test_train_step_skip_under_fp8(one_rank, tmp_path):
    from megatron_jetrl.actor.train_step import train_step

    cfg = _cfg(tmp_path / "r")
    ddp, optimizer, _ = _actor(cfg)
    before = _params(ddp)
    step = dict(vocab_size=cfg.arch().vocab_size, micro_batch_size=2, on_nonfinite="skip")
    out = train_step(ddp, optimizer, _tokens(cfg), _loss("grad"), **step)
    assert out["ok"] is False and out["skipped"].startswith("rank 0: NaN/Inf in the gradients of [")
    assert all(torch.equal(before[n], p) for n, p in _params(ddp).items())
    assert train_step(ddp, optimizer, _tokens(cfg), _loss(None), **step)["ok"]  # and it trains on afterwards


def test_update_policy_on_nonfinite(one_rank, tmp_path, monkeypatch, capsys):
    """rl/step.py update_policy (jetrl): a NaN reward stops the run naming step and completion, or skips the update;
    a NaN loss skips it naming rank and tensors. A skip is one line on rank 0 and the metrics' `skipped`."""
    from megatron_jetrl.actor.train_step import NonFiniteError
    from megatron_jetrl.rl import step as train
    from megatron_jetrl.rl.context import RunContext

    batch, outcome = _rollout(one_rank, tmp_path, None)
    outcome.rewards[5] = float("nan")
    ddp, optimizer, _ = _actor(_cfg(tmp_path / "r"))

    def update(policy):
        cfg = _cfg(tmp_path / "r", "grpo.prompts_per_step=2", "grpo.micro_batch_size=8", f"run.on_nonfinite={policy}")
        s = SimpleNamespace(
            cfg=cfg, model=ddp, optimizer=optimizer, arch=cfg.arch(), is_main=True, offload=None, run=RunContext()
        )
        return train.update_policy(s, 3, outcome, batch, batch.rollout_logprobs, None)

    with pytest.raises(
        NonFiniteError,
        match=r"step 3: non-finite reward nan of completion 5 \(prompt 1, sample 1; 1 non-finite "
        r"reward\(s\) in all\): check the reward function; the update was not applied.*on_nonfinite=skip",
    ):
        update("stop")
    before = _params(ddp)
    out = update("skip")
    assert out["skipped_updates"] == 1 and out["skipped"].startswith("non-finite reward nan of completion 5")
    assert capsys.readouterr().err.startswith("step 3: update skipped: non-finite reward nan of completion 5")
    outcome.rewards[5] = 1.0
    monkeypatch.setattr(train, "policy_loss", lambda logprobs, *a, **kw: (logprobs.sum() * float("nan"), {}))
    out = update("skip")
    assert out["skipped_updates"] == 1 and out["grad_norm"] is None
    assert capsys.readouterr().err.startswith("step 3: update skipped: rank 0: NaN/Inf in ['loss'] from the loss callback")
    assert all(torch.equal(before[n], p) for n, p in _params(ddp).items())


# ---- in-process: what a broken rollout engine hands back --------------------------------------------------


class FakeEngine:
    """Answers every prompt with n completions of `length` tokens (logprob -0.5 each), then `breaks` them."""

    def __init__(self, breaks=None, length=3):
        self.breaks, self.length = breaks, length

    def generate(self, prompts, sampling, *, request_seeds=None):
        from megatron_jetrl.rollout.engine import Completion, RequestOutput

        outs = [
            RequestOutput(list(p), [Completion([5 + i] * self.length, [-0.5] * self.length, "length") for i in range(sampling.n)])
            for p in prompts
        ]
        if self.breaks is not None:
            self.breaks(outs)
        return outs


class FakeTokenizer:
    pad_id, eos_id = 0, 2

    def encode(self, text):
        return [3 + ord(c) % 200 for c in text]

    def decode(self, ids):
        return "".join(chr(48 + i % 10) for i in ids)


def _rollout(one_rank, tmp_path, breaks, **engine):
    from megatron_jetrl.grpo.data import ArithmeticTask, PromptSampler
    from megatron_jetrl.rl.context import RunContext
    from megatron_jetrl.rl.step import rollout
    from megatron_jetrl.rollout.pool import RankZeroPool, RolloutPool

    cfg = _cfg(tmp_path / "r", "grpo.prompts_per_step=2", "grpo.micro_batch_size=8")
    s = SimpleNamespace(
        cfg=cfg,
        arch=cfg.arch(),
        is_main=True,
        offload=None,
        tokenizer=FakeTokenizer(),
        run=RunContext(),
        pool=RankZeroPool(RolloutPool([FakeEngine(breaks, **engine)])),
        device=torch.device("cpu"),
        sampler=PromptSampler(ArithmeticTask(high=5).problems(8, seed=0), 2, seed=0),
    )
    return rollout(s, 0)


def test_rollout_batch_of_a_sound_engine(one_rank, tmp_path):
    batch, outcome = _rollout(one_rank, tmp_path, None)
    assert len(batch) == 8 and int(batch.mask.sum()) == 8 * 3
    assert outcome.response_lengths.tolist() == [3] * 8 and bool(outcome.truncated.all())
    assert torch.equal(outcome.rewards, batch.rewards)


def _die():
    raise RuntimeError("engine process 1234 exited with signal 9 (a vLLM worker, say)")


def _set(attr, value, which=0):
    def breaks(outs):
        setattr(outs[0].completions[which], attr, value(getattr(outs[0].completions[which], attr)))

    return breaks


ENGINE_REFUSED = {
    "dies": (lambda outs: _die(), RuntimeError, r"engine process 1234 exited with signal 9"),
    "a logprob missing": (
        _set("logprobs", lambda lp: lp[:-1]),
        ValueError,
        r"the rollout engine returned a malformed completion \(3 tokens, 2 logprobs\)",
    ),
    "an empty completion": (_set("token_ids", lambda t: []), ValueError, r"malformed completion \(0 tokens, 3 logprobs\)"),
    "an output missing": (lambda outs: outs.pop(), RuntimeError, r"returned 1 outputs for 2 prompts"),
}


@pytest.mark.parametrize("case", list(ENGINE_REFUSED))
def test_broken_engine_output_is_refused_before_training(one_rank, tmp_path, case):
    breaks, kind, message = ENGINE_REFUSED[case]
    with pytest.raises(kind, match=message):
        _rollout(one_rank, tmp_path, breaks)


MALFORMED = {
    "a token id past the vocabulary": (
        _set("token_ids", lambda t: [10**6, *t[1:]]),
        r"token id 1000000 in completion 0 of prompt 0, outside the vocabulary \[0, 256\)",
    ),
    "a negative token id": (_set("token_ids", lambda t: [-1, *t[1:]], which=2), r"token id -1 in completion 2 of prompt 0"),
    "a NaN logprob": (
        _set("logprobs", lambda lp: [float("nan"), *lp[1:]]),
        r"logprob nan in completion 0 of prompt 0; a logprob is finite and <= 0",
    ),
    "a positive logprob": (_set("logprobs", lambda lp: [3.0, *lp[1:]]), r"logprob 3.0 in completion 0 of prompt 0"),
    "groups of n-1 and n+1 samples": (
        lambda outs: outs[1].completions.append(outs[0].completions.pop()),
        r"returned 3 completions for prompt 0, rollout.n=4 are needed",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_engine_output_is_refused(one_rank, tmp_path, case):
    breaks, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        _rollout(one_rank, tmp_path, breaks)


# ---- the fault-injection module itself --------------------------------------------------------------------


def test_fault_spec_parsing():
    from fault_injection import FaultSpecError, parse

    faults = parse("kill@update:step=1:rank=1, nan@reward,die@engine:step=0")
    assert [str(f) for f in faults] == ["kill@update:step=1:rank=1", "nan@reward", "die@engine:step=0"]
    for bad, message in {
        "kill": "not ACTION@POINT",
        "kill@nowhere": "not ACTION@POINT",
        "nan@update": "must be one of",
        "kill@save:step=x": "step=<int>",
        "kill@save:when=1": "step=<int>",
    }.items():
        with pytest.raises(FaultSpecError, match=message):
            parse(bad)


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def test_optimizer_state_of_the_other_kind_is_refused(saved, tmp_path):
    """A replicated optimizer's checkpoint resumed with optim.distributed=true (and the reverse) names the switch."""
    from megatron_jetrl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_jetrl.models.shards import CheckpointError

    ddp, optimizer, flow = _actor(_cfg(tmp_path / "d", "loss.kl_coef=0", "optim.distributed=true"))
    with pytest.raises(
        CheckpointError,
        match=r"optim_tp00_pp000.pt holds the state of a replicated optimizer and this run's is "
        r"distributed: resume with optim.distributed=false",
    ):
        load_checkpoint(ddp, saved.ck, optimizer=optimizer)
    ck = tmp_path / "distributed"
    ck.mkdir()
    save_checkpoint(ddp, ck, hf_config=saved.cfg.model.architecture(), flow=flow, iteration=1, optimizer=optimizer)
    with pytest.raises(
        CheckpointError,
        match=r"holds the state of a distributed optimizer and this run's is replicated: "
        r"resume with optim.distributed=true",
    ):
        load_checkpoint(saved.ddp, ck, optimizer=saved.optimizer)
