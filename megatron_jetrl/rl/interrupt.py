"""Interrupts of a run: Ctrl-C (SIGINT) and SIGUSR1 (SLURM's `--signal` warning before a pre-emption; what the
launcher sends the ranks when it gets SIGTERM).

The first signal asks the run to stop at the end of the GRPO step it is in: every rank agrees on it at that step's end
(one all-reduce of a flag per step), the run writes a checkpoint there (with `run.checkpoint`) and stops with one line:
where it stopped, the checkpoint it resumes from and the command that resumes it. A second signal, or one during
start-up or the warm-start (before any GRPO step), stops it at once; it resumes from its newest checkpoint. SIGTERM
to a rank keeps its default, an immediate end: it is what torchrun sends the survivors when a rank fails.

Under `launch/train_grpo.sh` (JETRL_EXIT_DIR set) each rank writes its pid there and the launcher passes a signal it
gets on to the ranks (torchrun runs in its own session, so a terminal's Ctrl-C reaches only the launcher; its SIGTERM
goes on as SIGUSR1). The ranks leave with exit 0 (torchrun then stays quiet) after rank 0 wrote the signal and the line
to `interrupted`, and the launcher prints it last and exits 128 + the signal it got (130 for SIGINT, 143 for SIGTERM).
A rank started without the launcher prints the line itself and exits with that code.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_jetrl.rl.context import RunContext

SIGNALS = (signal.SIGINT, signal.SIGUSR1)


class Interrupts:
    """This rank's signal handlers; `stop_requested` agrees over the ranks."""

    def __init__(self, run: RunContext):
        self.signum: int | None = None  # the signal the run stops on: this rank's, or one the ranks agreed on
        self.received: int | None = None  # the first signal this rank got itself
        self.graceful = False  # the GRPO loop is running: stop at the end of the step
        self.run = run  # where an immediate stop says it stopped
        self.previous: dict = {}
        self.exit_dir = os.environ.get("JETRL_EXIT_DIR")

    def install(self) -> None:
        """Handle the signals in this process (the main thread only: where Python delivers signals)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        if self.exit_dir:
            rank = os.environ.get("RANK", "0")
            try:
                Path(self.exit_dir, f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
            except OSError:
                pass

    def _handle(self, signum, frame) -> None:
        # A second signal is this rank's own second one: the launcher passes each signal to every rank, one after the
        # other, so a rank's first one may come after the ranks already agreed to stop on another rank's.
        if self.received is None and self.graceful:
            self.received = signum
            self.signum = self.signum or signum
            return
        self.signum = self.signum or signum
        where = f"GRPO step {self.run.step}" if self.run.step is not None else (self.run.current or "start-up")
        self.leave(f"stopped at once during {where}: nothing saved since the newest checkpoint, where a restart resumes")

    def restore(self) -> None:
        """The handlers from before `install` (a run that ended: the process may go on, as in the tests)."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def stop_requested(self, device) -> bool:
        """Collective: whether any rank got a signal (all ranks then stop after this step)."""
        flag = torch.tensor([float(self.signum or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item()) or None
        return self.signum is not None

    def announce(self, line: str) -> int:
        """Rank 0 says `line` (to the launcher, or on stderr); the exit code this rank leaves with: 0 under the
        launcher (torchrun then stays quiet; the launcher exits 128 + the signal), else 128 + the signal."""
        from megatron_jetrl.rl import run_lock

        name = signal.Signals(self.signum).name
        rank = os.environ.get("RANK", "0")
        run_lock.release_all()
        if rank == "0":
            if self.exit_dir:
                try:
                    Path(self.exit_dir, "interrupted").write_text(f"{name}\t{line}\n")
                except OSError:
                    pass
            else:
                print(f"interrupted ({name}): {line}", file=sys.stderr, flush=True)
        return 0 if self.exit_dir else 128 + self.signum

    def leave(self, line: str) -> None:
        """End this rank at once (a second signal, or one before the GRPO loop): `announce`, then exit."""
        code = self.announce(line)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
