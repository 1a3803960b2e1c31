"""The run context: where a GRPO run is, said to whatever watches it.

The trainer opens each part of a run as a phase of its `RunContext` (`with run.phase("rollout"):`, inside GRPO step
`run.step`; start-up, the warm-start, a stop and the export are phases with no step). What watches the run subscribes
to it: the failure report and the heartbeat (rl/faults.py: the step and phase a rank failed in, the position a killed
rank said last), the profiler (rl/profiling.py), the metrics file and the progress bar (`on_step_end`), and plugins.
Nothing reads the trainer's frames or replaces its names.

A subscriber is any object with some of these methods; they are called in the order of subscription (a phase's end
in the reverse order):

    on_phase(run, name)                 a phase begins (`run.step`, `run.current` say where)
    on_phase_end(run, name, error)      it ends; `error` is the exception leaving it, or None
    on_step_end(run, row)               the step's metrics row is complete
    on_end(run)                         the GRPO loop is over (its last step done, or stopped by a signal)
    on_event(run, name, info)           something happened at one of `EVENTS` (info: a dict)
    tap(run, point, value)              the trainer's data at one of `TAPS` passes through: the value to go on with

A subscriber that raises is not swallowed: the exception goes on from where the subscriber was called, with a note
naming the subscriber.

Plugins: `JETRL_PLUGINS="module:function,..."` names functions that are called with the context once the process group
exists, and subscribe what they need (the fault-injection tests arm their faults this way: tests/fault_injection.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass, field
from typing import Any

PLUGINS_ENV = "JETRL_PLUGINS"
TAPS = {
    "outputs": "the rollout engines' outputs of a step (list[RequestOutput]), before they are checked and scored",
    "rewards": "the rewards of a step's completions (list[float]), before the group advantages",
    "logprobs": "the policy's logprobs of a micro-batch (autograd flows through), before its loss",
    "loss": "a micro-batch's policy loss, before its backward",
}
EVENTS = {
    "checkpoint_staged": "a checkpoint's actor shards and optimizer state are staged, its trainer state not yet written "
    "(info: step, directory)",
    "export_shard": "an export wrote one safetensors shard (info: path)",
}
HOOKS = ("on_phase", "on_phase_end", "on_step_end", "on_end", "on_event", "tap")


@dataclass
class RunContext:
    """Where this rank's run is (`step`: the GRPO step, None outside the loop; `current`: the phase, None between
    phases) and who watches it."""

    step: int | None = None
    current: str | None = None
    subscribers: list = field(default_factory=list)

    def subscribe(self, subscriber) -> None:
        if not any(callable(getattr(subscriber, h, None)) for h in HOOKS):
            raise TypeError(f"{subscriber!r} has none of the run's hooks {HOOKS}")
        self.subscribers.append(subscriber)

    def unsubscribe(self, subscriber) -> None:
        self.subscribers.remove(subscriber)

    @contextlib.contextmanager
    def phase(self, name: str):
        """The phase `name` of this step: said to the subscribers as it begins and ends. An exception leaving it keeps
        `current` at `name` (the failure report reads it)."""
        outer = self.current
        self.current = name
        entered = []
        try:
            for sub in self.subscribers:
                self._call(sub, "on_phase", self, name)
                entered.append(sub)
            yield
        except BaseException as e:
            self._end(entered, name, e)
            raise
        self._end(entered, name, None)
        self.current = outer

    def _end(self, entered: list, name: str, error: BaseException | None) -> None:
        for sub in reversed(entered):
            self._call(sub, "on_phase_end", self, name, error)

    def end_step(self, row: dict) -> None:
        for sub in self.subscribers:
            self._call(sub, "on_step_end", self, row)

    def end(self) -> None:
        for sub in self.subscribers:
            self._call(sub, "on_end", self)

    def event(self, name: str, **info: Any) -> None:
        if name not in EVENTS:
            raise KeyError(f"unknown run event {name!r}: one of {sorted(EVENTS)}")
        for sub in self.subscribers:
            self._call(sub, "on_event", self, name, info)

    def tap(self, point: str, value):
        """`value` after every subscriber's `tap` (unchanged without one)."""
        if point not in TAPS:
            raise KeyError(f"unknown run tap {point!r}: one of {sorted(TAPS)}")
        for sub in self.subscribers:
            if hasattr(sub, "tap"):
                value = self._call(sub, "tap", self, point, value)
        return value

    @staticmethod
    def _call(sub, hook: str, *args):
        method = getattr(sub, hook, None)
        if method is None:
            return args[-1] if hook == "tap" else None
        try:
            return method(*args)
        except BaseException as e:
            e.add_note(f"(raised by the run subscriber {type(sub).__name__}.{hook})")
            raise

    def load_plugins(self, spec: str | None = None) -> list[str]:
        """Call each `module:function` of `spec` (default: $JETRL_PLUGINS) with this context; the names called."""
        spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
        names = [item.strip() for item in spec.split(",") if item.strip()]
        for item in names:
            module, sep, function = item.partition(":")
            if not sep or not module or not function:
                raise ValueError(f"{PLUGINS_ENV}: {item!r} is not module:function")
            getattr(importlib.import_module(module), function)(self)
        return names
