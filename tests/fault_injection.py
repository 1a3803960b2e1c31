"""Fault injection for the tests in tests/e2e/test_faults.py (RELIABILITY.md lists the faults tried): a plugin of the
trainer's run context (megatron_jetrl/rl/context.py) that arms the faults named in the environment variable
`JETRL_FAULT`. Nothing in the package imports it; a run loads it with

    PYTHONPATH=<repo>/tests JETRL_PLUGINS=fault_injection:install JETRL_FAULT=... bash launch/train_grpo.sh ...

    JETRL_FAULT="ACTION@POINT[:step=N][:rank=R][,ACTION@POINT...]"

step: the GRPO step (0-based, as in metrics.jsonl; for `save`, the checkpoint's step number); rank: the global
rank (default: every rank). Each fault fires once per process.

* `kill|stop|raise|exit|int @ rollout|eval|update|sync`: SIGKILL / SIGSTOP (a frozen rank) / a RuntimeError /
  os._exit(3) / SIGINT (Ctrl-C reaching this rank alone), as that phase of the step begins;
* `kill|stop|raise|exit @ save`: the same, once the actor's shards and optimizer state of checkpoint `step` are
  staged and before its trainer_state.json is written (the run's `checkpoint_staged` event);
* `kill|stop|raise|exit @ export`: the same, once the export's first safetensors shard is written (`export_shard`);
* `nan|inf @ reward`: the first reward of this rank's rows (the `rewards` tap); `@ loss`: the policy loss of every
  micro-batch of the step (`loss`); `@ grad`: the gradient of the logprobs, the loss staying finite (`logprobs`);
* `die|malformed|badtoken|nanlogprob|short @ engine`: the step's engine outputs (`outputs`) raise / lose a logprob
  / carry a token id past the vocabulary / a NaN logprob / a prompt with n-1 samples.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass

import torch

from megatron_jetrl.rl.faults import _rank, _say

ENV = "JETRL_FAULT"
PHASE_POINTS = ("rollout", "eval", "update", "sync")
PROCESS_ACTIONS = ("kill", "stop", "raise", "exit", "int")
POISON_ACTIONS = ("nan", "inf")
ENGINE_ACTIONS = ("die", "malformed", "badtoken", "nanlogprob", "short")
POINTS = {
    **{p: PROCESS_ACTIONS for p in (*PHASE_POINTS, "save", "export")},
    "reward": POISON_ACTIONS,
    "loss": POISON_ACTIONS,
    "grad": POISON_ACTIONS,
    "engine": ENGINE_ACTIONS,
}
POISON = {"nan": math.nan, "inf": math.inf}


class FaultSpecError(ValueError):
    """JETRL_FAULT does not parse."""


class InjectedFault(RuntimeError):
    """Raised by an armed `raise@POINT` fault, or by an engine armed with `die@engine`."""


@dataclass
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None
    fired: bool = False

    def __str__(self) -> str:
        extra = "".join(f":{k}={v}" for k, v in (("step", self.step), ("rank", self.rank)) if v is not None)
        return f"{self.action}@{self.point}{extra}"

    def matches(self, step: int | None) -> bool:
        """This rank, this step (or no step given)."""
        return (self.rank is None or self.rank == _rank()) and (self.step is None or step == self.step)

    def due(self, step: int | None) -> bool:
        """`matches`, the first time only."""
        if self.fired or not self.matches(step):
            return False
        self.fired = True
        return True


def parse(spec: str) -> list[Fault]:
    """`JETRL_FAULT`'s value -> faults (FaultSpecError naming the bad item and the choices)."""
    faults = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        head, *options = item.split(":")
        action, sep, point = head.partition("@")
        if not sep or point not in POINTS:
            raise FaultSpecError(f"{ENV}: {item!r} is not ACTION@POINT with POINT one of {sorted(POINTS)}")
        if action not in POINTS[point]:
            raise FaultSpecError(f"{ENV}: {item!r}: action {action!r} at {point} must be one of {list(POINTS[point])}")
        fault = Fault(action, point)
        for option in options:
            key, sep, value = option.partition("=")
            if key not in ("step", "rank") or not sep or not value.lstrip("-").isdigit():
                raise FaultSpecError(f"{ENV}: {item!r}: option {option!r} must be step=<int> or rank=<int>")
            setattr(fault, key, int(value))
        faults.append(fault)
    return faults


def _act(fault: Fault, where: str) -> None:
    _say(f"rank {_rank()}: injected fault {fault} fires {where}")
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "int":  # Ctrl-C reaching this rank alone: the run stops at the end of the step
        os.kill(os.getpid(), signal.SIGINT)
    elif fault.action == "exit":
        os._exit(3)
    elif fault.action == "raise":
        raise InjectedFault(f"injected fault {fault} {where}")


class Injector:
    """The armed faults, as a subscriber of the run context."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    def of(self, point: str) -> list[Fault]:
        return [f for f in self.faults if f.point == point]

    def on_phase(self, run, name: str) -> None:
        if name in PHASE_POINTS:
            for f in self.of(name):
                if f.due(run.step):
                    _act(
                        f, f"before the rollout of step {run.step}" if name == "rollout" else f"before {name} at step {run.step}"
                    )

    def on_event(self, run, name: str, info: dict) -> None:
        if name == "checkpoint_staged":
            for f in self.of("save"):
                if f.due(info["step"]):
                    _act(f, f"after staging the actor of checkpoint {info['directory']}")
        elif name == "export_shard":
            for f in self.of("export"):
                if f.due(f.step):  # step is not used here: the export follows the last step
                    _act(f, f"after writing {info['path']}")

    def tap(self, run, point: str, value):
        if point == "outputs":
            for f in self.of("engine"):
                if f.due(run.step):
                    _say(f"rank {_rank()}: injected fault {f} at the rollout of step {run.step}")
                    _break(value, f.action)
        elif point == "rewards":
            for f in self.of("reward"):
                if f.due(run.step):
                    _say(f"rank {_rank()}: injected fault {f}: reward[0] := {f.action}")
                    value = list(value)
                    value[0] = math.nan if f.action == "nan" else math.inf
        elif point in ("logprobs", "loss"):
            for f in self.of("grad" if point == "logprobs" else "loss"):
                if f.matches(run.step):
                    f.fired = True
                    value = PoisonGrad.apply(value, POISON[f.action]) if point == "logprobs" else value * POISON[f.action]
        return value


def install(run) -> None:
    """The plugin (`JETRL_PLUGINS=fault_injection:install`): subscribe the faults of $JETRL_FAULT, if any."""
    spec = os.environ.get(ENV, "")
    if spec:
        run.subscribe(Injector(parse(spec)))
        _say(f"rank {_rank()}: fault injection armed ({ENV}={spec!r})")


def _break(outputs, action: str) -> None:
    """What a broken engine hands back (in place)."""
    first = outputs[0].completions[0]
    if action == "die":
        raise InjectedFault("the rollout engine died (injected fault die@engine)")
    if action == "malformed":
        first.logprobs = first.logprobs[:-1]
    elif action == "badtoken":
        first.token_ids = [10**6, *first.token_ids[1:]]
    elif action == "nanlogprob":
        first.logprobs = [math.nan, *first.logprobs[1:]]
    elif action == "short":
        outputs[0].completions = outputs[0].completions[:-1]


class PoisonGrad(torch.autograd.Function):
    """Identity forward; the backward hands on a gradient full of `value` (the loss stays finite)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, ctx.value), None
