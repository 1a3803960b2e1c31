"""`rendezvous.leave_together`: at the end of a run no rank exits before every rank is out of its last collective, and
rank 0 (the store's host when ranks are started by hand) leaves last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gloo import free_port

ROOT = Path(__file__).resolve().parents[2]
RANK = r"""
import datetime, json, os, sys, time
import torch.distributed as dist
from megatron_jetrl.rl.rendezvous import leave_together

rank, delay = int(os.environ["RANK"]), float(sys.argv[1])
if rank == 0:  # the store's host, as when the ranks are started without torchrun
    server = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
time.sleep(delay)
arrived = time.time()
leave_together(timeout=float(sys.argv[2]))
print(json.dumps({"rank": rank, "arrived": arrived, "left": time.time()}), flush=True)
if rank == 0:
    time.sleep(0.5)  # the store stays up a moment: the others may still read it
"""


def ranks(delays, timeout=30.0):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(d), str(timeout)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(len(delays)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": str(ROOT),
            },
        )
        for r, d in enumerate(delays)
    ]
    out = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return out


def test_no_rank_leaves_before_the_last_arrives_and_rank_0_leaves_last():
    r0, r1, r2 = ranks([0.0, 1.5, 0.3])
    last = max(r["arrived"] for r in (r0, r1, r2))
    assert min(r["left"] for r in (r0, r1, r2)) >= last  # nobody left before rank 1 came out of its "collective"
    assert r0["left"] >= max(r1["left"], r2["left"]) - 0.05  # rank 0 after the others have seen the count


def test_a_missing_rank_bounds_the_wait_by_the_timeout():
    r0, r1 = ranks([0.0, 4.0], timeout=1.0)  # rank 1 arrives after rank 0 gave up waiting
    assert 0.9 <= r0["left"] - r0["arrived"] < 3.0
