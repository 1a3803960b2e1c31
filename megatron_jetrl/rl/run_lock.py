"""One run at a time in a run directory: `<run dir>/run.lock` names the process that holds it.

A run's first rank takes the lock before it writes anything (`acquire`, from `rl/train.py`) and gives it back when its
process ends (`release`, at exit). The lock is a JSON file made with O_EXCL: pid, host, and the process's start time
(field 22 of /proc/<pid>/stat on Linux), so a pid the kernel gave to another process since is not mistaken for the run.
A second launch on the same directory is refused in one line naming the holder, already by the launchers' question
(`rl/preflight.py` calls `check`), before torchrun starts. A lock whose process is gone on this host (a killed run) is
stale: the next run takes it over and says so. A lock from another host cannot be checked from here and is honoured;
its refusal says which file to delete once that run is known to be gone.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_jetrl.rl.config_schema import ConfigError

LOCK_FILE = "run.lock"
HELD: dict[Path, bool] = {}
"""The directories this process holds, each with whether `acquire` made it."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str  # the process's start time in clock ticks since boot ("" where /proc cannot say)
    since: str  # when it took the lock (UTC)

    def alive(self) -> bool | None:
        """Whether the holder still runs: None for another host (not checkable here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process with that pid
        return not self.started or process_start(self.pid) in ("", self.started)


def process_start(pid: int) -> str:
    """The start time of process `pid` (clock ticks since boot) from /proc, "" where it cannot be read, "exited" for a
    process that has ended but is not yet reaped (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        return "exited" if fields[0] in ("Z", "X") else fields[19]  # field 3 (state), field 22 (start time)
    except (OSError, ValueError, IndexError):
        return ""


def holder(directory: Path) -> Holder | None:
    """Who holds `directory`'s lock, or None (no lock; an unreadable one counts as none: it is replaced)."""
    try:
        data = json.loads((Path(directory) / LOCK_FILE).read_text())
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("started", "")), str(data.get("since", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(directory: Path) -> None:
    """ConfigError when another process holds `directory` (live, or on another host)."""
    h = holder(directory)
    if h is None or (h.pid == os.getpid() and h.host == socket.gethostname()):
        return
    alive = h.alive()
    if alive is False:
        return
    lock = Path(directory) / LOCK_FILE
    where = f"PID {h.pid} on {h.host} (since {h.since})" if h.since else f"PID {h.pid} on {h.host}"
    fix = (
        "wait for it or stop it, or give this run another run.name"
        if alive
        else f"another host's run cannot be checked from here: once it is gone, delete {lock}; or give this run another run.name"
    )
    raise ConfigError(f"{directory} is in use by another run, {where}: {fix}")


def acquire(directory: Path) -> str | None:
    """Take `directory`'s lock for this process (released at exit); a note when it took over a stale one, else None.
    ConfigError when a live run holds it."""
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    body = json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": process_start(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )
    note = None
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            check(directory)  # a live holder: refused
            stale = holder(directory)
            if stale is not None and stale.pid == os.getpid():
                return None  # this process holds it already
            note = (
                f"took over the lock of a run that is no longer running (PID {stale.pid} on {stale.host}, since {stale.since})"
                if stale
                else f"replaced an unreadable {lock}"
            )
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(body)
        HELD[directory.resolve()] = made
        return note
    raise ConfigError(f"could not take the lock {lock}: another launch took it at the same moment; launch one run per run.name")


def release(directory: Path) -> None:
    """Give `directory`'s lock back if this process holds it; a directory that `acquire` made goes too if the run left
    nothing else in it (a run refused after taking the lock leaves the directory as it was)."""
    made = HELD.pop(Path(directory).resolve(), False)
    h = holder(directory)
    if h is not None and h.pid == os.getpid() and h.host == socket.gethostname():
        (Path(directory) / LOCK_FILE).unlink(missing_ok=True)
        if made:
            try:
                Path(directory).rmdir()
            except OSError:
                pass  # not empty: the run's files stay


@atexit.register
def release_all() -> None:
    """Every lock this process still holds (at exit: a run that stopped early, or a test that ran the trainer)."""
    for directory in list(HELD):
        release(directory)
