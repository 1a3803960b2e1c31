"""How a GRPO run dies: one clear line naming the step, the phase and any lost rank; and fault injection
for the tests in tests/e2e/test_faults.py (RELIABILITY.md lists the faults tried).

The trainer calls `watch(cfg)` once, right after the process group exists. It

* starts a heartbeat: a daemon thread bumps the counter `jetrl/faults/beat/<rank>` in the c10d store
  every `interval` seconds (a separate TCPStore client on MASTER_ADDR:MASTER_PORT: torchrun's agent store,
  or rank 0's when the ranks are started by hand);
* installs a `sys.excepthook` that, when a rank dies of an exception, publishes its own failure, waits
  3 heartbeats to see which peers stopped beating (killed, crashed, or frozen), and prints

      jetrl: rank 0 failed at step 1 (update_policy): RuntimeError: ...Connection closed by peer...;
      lost rank(s) [1] (no heartbeat for 3.0 s: killed, crashed or frozen); newest complete checkpoint: <dir>

  (one line). A failure in `save`/`export` or an OSError also reports the free space of the run directory.
  A collective that never returns is bounded by run.timeout_s (the process group's timeout): the hook
  explains the failure, it does not detect it. In a run of several processes the rank then leaves at once
  (`os._exit(1)`; metrics lines are already fsync'ed): interpreter shutdown would run the destructors of a
  process group whose peer is lost, which took 1.4-7 s after the report here and over 9 s once in CI;
* arms the faults named in the environment variable `JETRL_FAULT` (off when unset):

      JETRL_FAULT="ACTION@POINT[:step=N][:rank=R][,ACTION@POINT...]"

  step: the GRPO step (0-based, as in metrics.jsonl; for `save`, the checkpoint's step number); rank:
  the global rank (default: every rank). Each fault fires once per process.

  * `kill|stop|raise|exit @ rollout|eval|update|sync`: SIGKILL / SIGSTOP (a frozen rank) / a RuntimeError /
    os._exit(3), before that phase of the step;
  * `kill|stop|raise|exit @ save`: the same, once the actor's shards and optimizer state of checkpoint
    `step` are staged and before its trainer_state.json is written;
  * `kill|stop|raise|exit @ export`: the same, once the export's first safetensors shard is written;
  * `nan|inf @ reward`: the first completion's reward; `@ loss`: the policy loss of every micro-batch of the
    step; `@ grad`: the gradient of the logprobs (the loss stays finite);
  * `die|malformed|badtoken|nanlogprob|short @ engine`: `RolloutPool.generate` raises / returns one logprob
    too few / a token id past the vocabulary / a NaN logprob / a prompt with n-1 samples.

`python -m megatron_jetrl.rl.faults ARGS` runs the trainer with `watch` in place (see `main`), so that
`JETRL_TRAIN_MODULE=megatron_jetrl.rl.faults bash launch/train_grpo.sh ...` arms faults even before
rl/train.py calls `watch` itself. Without `JETRL_FAULT` nothing here changes what a run computes; `watch` is
idempotent.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ENV = "JETRL_FAULT"
PREFIX = "jetrl/faults"
PHASE_POINTS = ("rollout", "eval", "update", "sync", "save", "export")
PROCESS_ACTIONS = ("kill", "stop", "raise", "exit")
POISON_ACTIONS = ("nan", "inf")
ENGINE_ACTIONS = ("die", "malformed", "badtoken", "nanlogprob", "short")
POINTS = {**{p: PROCESS_ACTIONS for p in PHASE_POINTS}, "reward": POISON_ACTIONS, "loss": POISON_ACTIONS,
          "grad": POISON_ACTIONS, "engine": ENGINE_ACTIONS}
_TRAIN_FUNCTIONS = {"rollout": "rollout", "eval": "actor_logprobs", "update": "update_policy", "sync": "sync"}


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _say(message: str) -> None:
    print(f"jetrl: {message}", file=sys.stderr, flush=True)


# ---- watch ------------------------------------------------------------------------------------------------

_WATCH: dict = {}


def watch(cfg=None, *, interval: float = 1.0, trainer: dict | None = None) -> None:
    """Heartbeat + failure report + JETRL_FAULT (see the module docstring). Call once the process group
    exists; later calls do nothing. `trainer`: the globals of the running trainer module (default: found on
    the call stack -- under `python -m megatron_jetrl.rl.train` that module is `__main__`)."""
    if _WATCH:
        return
    _WATCH.update(cfg=cfg, interval=interval, step=None, faults=[])
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        try:
            report(value, tb)
        except Exception as e:  # noqa: BLE001 - the report must never hide the original error
            _say(f"(failure report failed: {e!r})")
        if _world() > 1 and not issubclass(kind, KeyboardInterrupt):  # bounded exit: see the module docstring
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = hook
    _start_heartbeat(interval)
    spec = os.environ.get(ENV, "")
    if spec:
        faults = parse(spec)
        _WATCH["faults"] = faults
        _arm(faults, trainer if trainer is not None else _trainer_globals())
        _say(f"rank {_rank()}: fault injection armed ({ENV}={spec!r})")


def _is_trainer_main(code) -> bool:
    return code.co_name == "main" and code.co_filename.endswith(os.path.join("rl", "train.py"))


def _trainer_globals() -> dict:
    frame = sys._getframe(1)
    while frame is not None:
        if _is_trainer_main(frame.f_code):
            return frame.f_globals
        frame = frame.f_back
    from megatron_jetrl.rl import train

    return vars(train)


def _store():
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def _key(*parts) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "/".join((PREFIX, os.environ.get("TORCHELASTIC_RUN_ID", "run"), attempt, *map(str, parts)))


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _start_heartbeat(interval: float) -> None:
    if _world() < 2:
        return
    try:
        store = _store()
    except Exception as e:  # noqa: BLE001 - a run without a heartbeat still runs
        _say(f"rank {_rank()}: no heartbeat ({e!r}); a lost rank will not be named")
        return
    if store is None:
        return
    rank = _rank()
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            try:
                store.add(_key("beat", rank), 1)
            except Exception:  # noqa: BLE001 - the store went away (end of run, or its host died)
                return
            stop.wait(interval)

    thread = threading.Thread(target=beat, name="jetrl-heartbeat", daemon=True)
    thread.start()

    def join():
        # A daemon thread still inside a torch (pybind11) call when the interpreter finalizes is ended with
        # pthread_exit, whose unwinding through pybind11's noexcept GIL guard calls std::terminate: the run
        # "succeeds" and then aborts with SIGABRT. So the beat stops, and is waited for, before finalization.
        stop.set()
        thread.join(timeout=10.0)  # one store.add at most (its timeout is 5 s)

    atexit.register(join)


# ---- the report -------------------------------------------------------------------------------------------


def _where(tb) -> tuple[int | None, str | None]:
    """(GRPO step, phase function) of the trainer frame the exception went through."""
    step, phase, in_main = None, None, False
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        if in_main and phase is None and code.co_filename != __file__:  # not the wrappers of armed faults
            phase = code.co_name
        if _is_trainer_main(code):
            in_main, step = True, frame.f_locals.get("step")
    return step, phase


def lost_ranks(wait: float | None = None) -> tuple[list[int] | None, dict[int, str], str]:
    """(ranks whose heartbeat did not move for `wait` seconds, {rank: failure message others published},
    a note). None instead of the list when the store cannot be reached."""
    wait = 3 * _WATCH.get("interval", 1.0) if wait is None else wait
    me, world = _rank(), _world()
    others = [r for r in range(world) if r != me]
    try:
        store = _store()
        if store is None:
            return None, {}, "no MASTER_ADDR/MASTER_PORT: no heartbeat to read"
        first = {r: store.add(_key("beat", r), 0) for r in others}
        time.sleep(wait)
        second = {r: store.add(_key("beat", r), 0) for r in others}
        failed = {r: store.get(_key("failed", r)).decode(errors="replace") for r in others
                  if store.check([_key("failed", r)])}
    except Exception as e:  # noqa: BLE001
        host = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return None, {}, f"the rendezvous store at {host} is unreachable ({type(e).__name__}): its host (rank 0 when started without torchrun) is lost"
    return [r for r in others if second[r] == first[r] and r not in failed], failed, ""


def _disk_note(cfg) -> str:
    if cfg is None:
        return ""
    directory = Path(cfg.run.directory)
    probe = next((p for p in (directory / "checkpoints", directory, *directory.parents) if p.exists()), None)
    if probe is None:
        return ""
    free = shutil.disk_usage(probe).free
    writable = os.access(probe, os.W_OK)
    return f"; {probe}: {free / 2**20:.1f} MiB free{'' if writable else ', not writable'}"


def _chain(exc):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def report(exc: BaseException, tb=None) -> str:
    """Print (and return) the one-line account of why this rank stops."""
    cfg = _WATCH.get("cfg")
    step, phase = _where(tb if tb is not None else exc.__traceback__)
    me = _rank()
    first_line = (str(exc).strip().splitlines() or [""])[0]
    line = f"rank {me} failed" + (f" at step {step}" if step is not None else "") + (f" ({phase})" if phase else "")
    line += f": {type(exc).__name__}: {first_line[:400]}"
    if _world() > 1 and not isinstance(exc, KeyboardInterrupt):
        try:
            store = _store()
            if store is not None:
                store.set(_key("failed", me), line)
        except Exception:  # noqa: BLE001
            pass
        lost, failed, note = lost_ranks()
        if lost:
            line += f"; lost rank(s) {lost} (no heartbeat for {3 * _WATCH.get('interval', 1.0):.1f} s: killed, crashed or frozen)"
        if failed:
            line += "; " + "; ".join(f"rank {r} reported: {m}" for r, m in sorted(failed.items()))
        if note:
            line += f"; {note}"
    chain = _chain(exc)
    codes = {e.errno for e in chain if isinstance(e, OSError)}
    full = bool(codes & {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}) or any("No space left on device" in str(e) for e in chain)
    if phase in ("save", "export") or codes or full:
        note = _disk_note(cfg)
        line += note
        free = re.search(r": ([0-9.]+) MiB free", note)
        if full or (free and float(free.group(1)) < 64):
            line += " (out of space)" if full else " (nearly full: out of space?)"
    if cfg is not None:
        try:
            from megatron_jetrl.rl.session import latest_checkpoint

            ckpt = latest_checkpoint(cfg)
            line += f"; newest complete checkpoint: {ckpt} (a restart resumes there)" if ckpt else "; no complete checkpoint yet"
        except Exception:  # noqa: BLE001
            pass
    _say(line)
    return line


# ---- injection --------------------------------------------------------------------------------------------


def _act(fault: Fault, where: str) -> None:
    _say(f"rank {_rank()}: injected fault {fault} fires {where}")
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
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
        _WATCH["step"] = step
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
                if f.due(_WATCH["step"]):
                    _say(f"rank {_rank()}: injected fault {f}: reward[0] := {f.action}")
                    rewards[0] = math.nan if f.action == "nan" else math.inf
            return rewards

        train["compute_rewards"] = compute_rewards

    if of("loss") or of("grad"):
        original_loss = train["policy_loss"]
        value = {"nan": math.nan, "inf": math.inf}

        def policy_loss(logprobs, *args, **kw):
            for f in of("grad"):
                if f.matches(_WATCH["step"]):
                    f.fired = True
                    logprobs = PoisonGrad.apply(logprobs, value[f.action])
            loss, metrics = original_loss(logprobs, *args, **kw)
            for f in of("loss"):
                if f.matches(_WATCH["step"]):
                    f.fired = True
                    loss = loss * value[f.action]
            return loss, metrics

        train["policy_loss"] = policy_loss

    if of("engine"):
        original_generate = pool.RolloutPool.generate

        def generate(self, prompts, sampling=None, **kw):
            outputs = original_generate(self, prompts, sampling, **kw)
            for f in of("engine"):
                if f.due(_WATCH["step"]):
                    _say(f"rank {_rank()}: injected fault {f} at the rollout of step {_WATCH['step']}")
                    _break(outputs, f.action)
            return outputs

        pool.RolloutPool.generate = generate


def _before(function, point: str, faults: list[Fault]):
    def wrapped(*args, **kw):
        for f in faults:
            if f.due(_WATCH["step"]):
                _act(f, f"before {point} at step {_WATCH['step']}")
        return function(*args, **kw)

    return wrapped


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
    """`python -m megatron_jetrl.rl.faults [CONFIG.yaml] [section.key=value ...]`: the GRPO trainer with `watch`
    installed right after `init_distributed`, for as long as rl/train.py does not call it itself (then the two
    are the same). As a launcher module: `JETRL_TRAIN_MODULE=megatron_jetrl.rl.faults
    JETRL_CONFIG_MODULE=megatron_jetrl.rl.config JETRL_FAULT=... bash launch/train_grpo.sh ...`."""
    from megatron_jetrl.rl import faults, session, train  # `faults`: the module the trainer imports, not __main__

    init = session.init_distributed

    def init_distributed(cfg):
        init(cfg)
        faults.watch(cfg)

    session.init_distributed = init_distributed
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
