"""The c10d store of a run's ranks, beside the process group: the failure report's heartbeat (rl/faults.py) and the
end of a run (`leave_together`) talk through it. Each use opens its own client of MASTER_ADDR:MASTER_PORT (torchrun's
agent store, or rank 0's when the ranks are started by hand); keys live under `PREFIX/<run id>/<restart attempt>/`."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

PREFIX = "jetrl/faults"


def store():
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def key(*parts) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "/".join((PREFIX, os.environ.get("TORCHELASTIC_RUN_ID", "run"), attempt, *map(str, parts)))


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def leave_together(timeout: float = 60.0) -> None:
    """After the last collective of a run of several processes: no rank exits (closing its connections) while a peer
    may still be inside that collective, which then fails with "Connection closed by peer". Every rank counts itself
    out in the store and waits for all; rank 0, the store's host when ranks are started by hand, leaves last. A lost
    store or `timeout` ends the wait: the run's work is done either way."""
    if _world() < 2:
        return
    try:
        client = store()
        if client is None:
            return
        world, rank, end = _world(), _rank(), time.monotonic() + timeout
        out, gone = key("leave", "out"), key("leave", "gone")
        client.add(out, 1)
        while client.add(out, 0) < world and time.monotonic() < end:
            time.sleep(0.01)
        if rank != 0:
            client.add(gone, 1)
            return
        while client.add(gone, 0) < world - 1 and time.monotonic() < end:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001, S110 - the store's host left: nobody is waiting any more
        pass
