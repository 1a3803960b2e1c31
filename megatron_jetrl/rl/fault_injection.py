"""Fault injection for the tests in tests/e2e/test_faults.py (RELIABILITY.md lists the faults tried); nothing
in a production run imports it.

`python -m megatron_jetrl.rl.fault_injection ARGS` is the GRPO trainer (rl/train.py) with the production watch
(`rl.faults.watch`) installed right after `init_distributed`, and the faults named in the environment variable
`JETRL_FAULT` armed:

    JETRL_FAULT="ACTION@POINT[:step=N][:rank=R][,ACTION@POINT...]"

step: the GRPO step (0-based, as in metrics.jsonl; for `save`, the checkpoint's step number); rank: the global
rank (default: every rank). Each fault fires once per process.

* `kill|stop|raise|exit|int @ rollout|eval|update|sync`: SIGKILL / SIGSTOP (a frozen rank) / a RuntimeError /
  os._exit(3) / SIGINT (Ctrl-C reaching this rank alone), before that phase of the step;
* `kill|stop|raise|exit @ save`: the same, once the actor's shards and optimizer state of checkpoint `step` are
  staged and before its trainer_state.json is written;
* `kill|stop|raise|exit @ export`: the same, once the export's first safetensors shard is written;
* `nan|inf @ reward`: the first completion's reward; `@ loss`: the policy loss of every micro-batch of the step;
  `@ grad`: the gradient of the logprobs (the loss stays finite);
* `die|malformed|badtoken|nanlogprob|short @ engine`: `RolloutPool.generate` raises / returns one logprob too
  few / a token id past the vocabulary / a NaN logprob / a prompt with n-1 samples.

As a launcher module: `JETRL_TRAIN_MODULE=megatron_jetrl.rl.fault_injection
JETRL_CONFIG_MODULE=megatron_jetrl.rl.config JETRL_FAULT=... bash launch/train_grpo.sh ...`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_jetrl.rl import faults as watch_module
from megatron_jetrl.rl.faults import _rank, _say

ENV = "JETRL_FAULT"
PHASE_POINTS = ("rollout", "eval", "update", "sync", "save", "export")
PROCESS_ACTIONS = ("kill", "stop", "raise", "exit", "int")
POISON_ACTIONS = ("nan", "inf")
ENGINE_ACTIONS = ("die", "malformed", "badtoken", "nanlogprob", "short")
POINTS = {**{p: PROCESS_ACTIONS for p in PHASE_POINTS}, "reward": POISON_ACTIONS, "loss": POISON_ACTIONS,
          "grad": POISON_ACTIONS, "engine": ENGINE_ACTIONS}
_TRAIN_FUNCTIONS = {"rollout": "rollout", "eval": "actor_logprobs", "update": "update_policy", "sync": "sync"}
_STATE: dict = {"step": None, "armed": False}
watch_module.WRAPPER_FILES.add(__file__)  # the report names the trainer's phase, not these wrappers


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


def _arm(faults: list[Fault], train: dict) -> None:
    """Wrap the trainer's phase functions (in `train`, the trainer module's globals), the checkpoint and
    export writers and the rollout pool so that the armed faults fire."""
    from megatron_jetrl.convert import hf_writer
    from megatron_jetrl.rl import session
    from megatron_jetrl.rollout import pool

    def of(point):
        return [f for f in faults if f.point == point]

    original_rollout = train["rollout"]

    def rollout(s, step):
        _STATE["step"] = step
        for f in of("rollout"):
            if f.due(step):
                _act(f, f"before the rollout of step {step}")
        return original_rollout(s, step)

    train["rollout"] = rollout  # always: it tracks the step for the other points

    for point in ("eval", "update", "sync"):
        if of(point):
            name = _TRAIN_FUNCTIONS[point]
            train[name] = _before(train[name], point, of(point))

    if of("save"):
        original_save = session.save_checkpoint

        def save_checkpoint(model, directory, **kw):
            original_save(model, directory, **kw)
            if Path(directory).name != "ref":
                for f in of("save"):
                    if f.due(kw.get("iteration")):
                        _act(f, f"after staging the actor of checkpoint {directory}")

        session.save_checkpoint = save_checkpoint

    if of("export"):
        original_flush = hf_writer.HFCheckpointWriter._flush

        def _flush(self):
            original_flush(self)
            for f in of("export"):
                if self._shards and f.due(f.step):  # step is not used here: the export follows the last step
                    _act(f, f"after writing {self.staging / self._shards[-1]['file']}")

        hf_writer.HFCheckpointWriter._flush = _flush

    if of("reward"):
        original_rewards = train["compute_rewards"]

        def compute_rewards(*args, **kw):
            rewards = list(original_rewards(*args, **kw))
            for f in of("reward"):
                if f.due(_STATE["step"]):
                    _say(f"rank {_rank()}: injected fault {f}: reward[0] := {f.action}")
                    rewards[0] = math.nan if f.action == "nan" else math.inf
            return rewards

        train["compute_rewards"] = compute_rewards

    if of("loss") or of("grad"):
        original_loss = train["policy_loss"]
        value = {"nan": math.nan, "inf": math.inf}

        def policy_loss(logprobs, *args, **kw):
            for f in of("grad"):
                if f.matches(_STATE["step"]):
                    f.fired = True
                    logprobs = PoisonGrad.apply(logprobs, value[f.action])
            loss, metrics = original_loss(logprobs, *args, **kw)
            for f in of("loss"):
                if f.matches(_STATE["step"]):
                    f.fired = True
                    loss = loss * value[f.action]
            return loss, metrics

        train["policy_loss"] = policy_loss

    if of("engine"):
        original_generate = pool.RolloutPool.generate

        def generate(self, prompts, sampling=None, **kw):
            outputs = original_generate(self, prompts, sampling, **kw)
            for f in of("engine"):
                if f.due(_STATE["step"]):
                    _say(f"rank {_rank()}: injected fault {f} at the rollout of step {_STATE['step']}")
                    _break(outputs, f.action)
            return outputs

        pool.RolloutPool.generate = generate


def _before(function, point: str, faults: list[Fault]):
    def wrapped(*args, **kw):
        step = _loop_step()
        for f in faults:
            if f.due(step):
                _act(f, f"before {point} at step {step}")
        return function(*args, **kw)

    return wrapped


def _loop_step() -> int | None:
    """The GRPO step of the trainer's main loop that is calling (the sync opens a step, before its rollout)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return watch_module._walk(reversed(frames))[0]


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


def main(argv: list[str] | None = None) -> int:
    """The GRPO trainer with `watch` installed and JETRL_FAULT armed right after `init_distributed` (see the
    module docstring); rl/train.py's own `watch` call then does nothing."""
    from megatron_jetrl.rl import session, train

    init = session.init_distributed

    def init_distributed(cfg):
        init(cfg)
        watch_module.watch(cfg)
        spec = os.environ.get(ENV, "")
        if spec and not _STATE["armed"]:
            _STATE["armed"] = True
            _arm(parse(spec), vars(train))
            _say(f"rank {_rank()}: fault injection armed ({ENV}={spec!r})")

    session.init_distributed = init_distributed
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
