"""A run's signal handling (megatron_jetrl/rl/interrupt.py): which signal stops at the end of the step and which at once.

The end-to-end behaviour (the launcher, the checkpoint, the exit codes) is tests/e2e/test_faults.py's; here the
decision itself, including the order the launcher's forwarding can produce: the ranks agree to stop on one rank's
signal before another rank's own copy of it arrives."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist

from megatron_jetrl.rl.context import RunContext
from megatron_jetrl.rl.interrupt import Interrupts


@pytest.fixture
def interrupts(monkeypatch):
    """Interrupts whose `leave` (an immediate exit) records its line instead."""
    monkeypatch.delenv("JETRL_EXIT_DIR", raising=False)
    i = Interrupts(RunContext(step=3))
    i.left = []
    monkeypatch.setattr(i, "leave", i.left.append)
    return i


def test_before_the_loop_a_signal_stops_at_once(interrupts):
    interrupts.run.step = None
    interrupts._handle(signal.SIGINT, None)
    assert interrupts.left == [
        "stopped at once during start-up: nothing saved since the newest checkpoint, where a restart resumes"
    ]
    assert interrupts.signum == signal.SIGINT


def test_in_the_loop_the_first_signal_waits_for_the_step_and_a_second_stops_at_once(interrupts):
    interrupts.graceful = True
    interrupts._handle(signal.SIGUSR1, None)
    assert interrupts.left == [] and interrupts.signum == interrupts.received == signal.SIGUSR1
    interrupts._handle(signal.SIGINT, None)
    assert interrupts.left == [
        "stopped at once during GRPO step 3: nothing saved since the newest checkpoint, where a restart resumes"
    ]
    assert interrupts.signum == signal.SIGUSR1  # the run stops on the first signal it got


def test_a_ranks_own_signal_after_the_ranks_agreed_on_anothers_is_its_first_not_its_second(interrupts, monkeypatch):
    """The launcher passes a Ctrl-C to each rank in turn: rank 0's handler may run, and the step's all-reduce agree to
    stop, before rank 1's copy arrives. That copy is rank 1's first signal: it must not end rank 1 at once while the
    others write the stop's checkpoint with it."""
    interrupts.graceful = True
    monkeypatch.setattr(dist, "all_reduce", lambda flag, op=None: flag.fill_(float(signal.SIGINT)))  # another rank's
    assert interrupts.stop_requested("cpu") and interrupts.signum == signal.SIGINT and interrupts.received is None
    interrupts._handle(signal.SIGINT, None)  # this rank's own copy, late
    assert interrupts.left == [] and interrupts.received == signal.SIGINT
    interrupts._handle(signal.SIGINT, None)  # a second Ctrl-C
    assert len(interrupts.left) == 1 and interrupts.left[0].startswith("stopped at once during GRPO step 3")


def test_the_agreement_carries_this_ranks_signal_and_none_without_one(interrupts, monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda flag, op=None: seen.append(float(flag)))
    assert not interrupts.stop_requested("cpu") and interrupts.signum is None
    interrupts.graceful = True
    interrupts._handle(signal.SIGUSR1, None)
    assert interrupts.stop_requested("cpu") and interrupts.signum == signal.SIGUSR1
    assert seen == [0.0, float(signal.SIGUSR1)]
