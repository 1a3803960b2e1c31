"""One run per run directory (megatron_jetrl/rl/run_lock.py): a live holder refuses a second run, naming its PID and
host; a killed one's lock is taken over with a note; the lock goes when the run ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_jetrl.rl import run_lock
from megatron_jetrl.rl.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def hold(directory: Path) -> subprocess.Popen:
    """Another process that takes the lock and sleeps."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from megatron_jetrl.rl import run_lock; import time; "
            f"run_lock.acquire({str(directory)!r}); print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_refuses_a_second_run_and_a_killed_ones_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    other = hold(run)
    try:
        h = run_lock.holder(run)
        assert h.pid == other.pid and h.host == socket.gethostname() and h.alive() is True
        for attempt in (run_lock.check, run_lock.acquire):
            with pytest.raises(
                ConfigError,
                match=rf"{run} is in use by another run, PID {other.pid} on "
                rf"{socket.gethostname()} \(since .* UTC\): wait for it or stop it, or "
                r"give this run another run.name",
            ):
                attempt(run)
    finally:
        other.kill()
        other.wait()
    assert run_lock.holder(run).alive() is False  # killed: its lock stays behind, stale
    run_lock.check(run)
    note = run_lock.acquire(run)
    assert note.startswith(f"took over the lock of a run that is no longer running (PID {other.pid} on ")
    assert run_lock.holder(run).pid == os.getpid() and run_lock.acquire(run) is None  # held: taking it again is a no-op
    run_lock.release(run)
    assert not (run / run_lock.LOCK_FILE).exists() and run.is_dir()  # the directory was there before: it stays


def test_a_reused_pid_and_another_hosts_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / run_lock.LOCK_FILE
    # this very process's pid, but another start time: the pid was given to another process since
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": "1", "since": "then"}))
    assert run_lock.holder(run).alive() is False
    lock.write_text(json.dumps({"pid": 1234, "host": "node-17", "started": "99", "since": "2026-01-01 00:00:00 UTC"}))
    assert run_lock.holder(run).alive() is None
    with pytest.raises(
        ConfigError,
        match=rf"in use by another run, PID 1234 on node-17 \(since 2026-01-01 00:00:00 UTC\): "
        rf"another host's run cannot be checked from here: once it is gone, delete {lock}",
    ):
        run_lock.acquire(run)
    lock.write_text("{not json")
    assert run_lock.acquire(run) == f"replaced an unreadable {lock}"
    run_lock.release(run)


def test_a_directory_the_lock_made_goes_with_it_when_the_run_left_nothing(tmp_path):
    fresh, used = tmp_path / "fresh", tmp_path / "used"
    assert run_lock.acquire(fresh) is None and run_lock.acquire(used) is None
    (used / "metrics.jsonl").write_text("{}\n")
    run_lock.release(fresh)
    run_lock.release(used)
    assert not fresh.exists() and sorted(p.name for p in used.iterdir()) == ["metrics.jsonl"]


def test_a_second_launch_on_a_held_directory_is_refused_before_torchrun(tmp_path):
    out = tmp_path / "run"
    other = hold(out)
    try:
        start = time.monotonic()
        r = subprocess.run(
            ["bash", str(REPO / "launch" / "train_grpo.sh"), f"run.out_dir={out}"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}, "PYTHON": sys.executable},
        )
    finally:
        other.kill()
        other.wait()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"config error: {out} is in use by another run, PID {other.pid} on {socket.gethostname()} "
        f"(since {run_lock.holder(out).since}): wait for it or stop it, or give this run another run.name"
    ]
    assert "process(es)" not in r.stderr and time.monotonic() - start < 30
