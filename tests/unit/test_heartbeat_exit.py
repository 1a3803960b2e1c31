"""The failure-report heartbeat (rl/faults.py) must not turn a finished run into SIGABRT at interpreter exit.

A daemon thread caught inside a torch store call while Python finalizes is ended with pthread_exit; the
unwinding crosses pybind11's noexcept GIL guard and std::terminate aborts the process ("terminate called
without an active exception", exit 134) after the run has printed its summary. CI met it once in ~30 launches
at a 1 s beat; a beat with no pause meets it on nearly every exit, which is what this test uses."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch.distributed as dist
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master.port), WORLD_SIZE="2", RANK="0")
    from megatron_jetrl.rl import faults
    faults._start_heartbeat(interval=0.0)  # beat without pause: always inside store.add
    time.sleep(0.3)
    print("done", flush=True)
    """
)


def test_a_run_with_the_heartbeat_exits_cleanly():
    for attempt in range(5):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "done", (attempt, proc.returncode, proc.stderr[-2000:])
