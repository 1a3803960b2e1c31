"""How a GRPO run dies: one clear line naming the step, the phase and any lost rank (RELIABILITY.md lists the faults
tried, tests/fault_injection.py injects them).

The trainer calls `watch(cfg, run)` once, right after the process group exists. It

* subscribes to the run context (rl/context.py): each phase a rank enters is its position, written to
  $JETRL_EXIT_DIR/rank<R>.where under the launcher (a rank killed without a word is named with its last step, phase
  and pipeline stage) and read by the failure report;
* starts a heartbeat: a daemon thread bumps the counter `jetrl/faults/beat/<rank>` in the c10d store every `interval`
  seconds (its own client of MASTER_ADDR:MASTER_PORT: torchrun's agent store, or rank 0's for ranks started by hand);
* installs a `sys.excepthook` that, when a rank dies of an exception, publishes its own failure, waits
  3 heartbeats to see which peers stopped beating (killed, crashed, or frozen), and prints

      jetrl: rank 0 failed at step 1 (update): RuntimeError: ...Connection closed by peer...;
      lost rank(s) [1] (no heartbeat for 3.0 s: killed, crashed or frozen); newest complete checkpoint: <dir>

  (one line; also recorded for the launcher, `record_failure`, which repeats it last). A failure in `save`/`export`
  or an OSError also reports the free space of the run directory.
  A collective that never returns is bounded by run.timeout_s (the process group's timeout): the hook
  explains the failure, it does not detect it. In a run of several processes the rank then leaves at once
  (`os._exit(1)`; metrics lines are already fsync'ed): interpreter shutdown would run the destructors of a
  process group whose peer is lost, which takes seconds.

`watch` is idempotent, and changes nothing a run computes.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from megatron_jetrl.rl.context import RunContext
from megatron_jetrl.rl.rendezvous import key as _key
from megatron_jetrl.rl.rendezvous import store as _store


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _say(message: str) -> None:
    print(f"jetrl: {message}", file=sys.stderr, flush=True)


# ---- watch ------------------------------------------------------------------------------------------------

_WATCH: dict = {}


def watch(cfg=None, run: RunContext | None = None, *, interval: float = 1.0) -> None:
    """Heartbeat + one-line failure report (see the module docstring) for the run context `run` (a fresh one when
    None). Call once the process group exists; a later call (another run in this process) only moves the report to
    its config and context."""
    run = RunContext() if run is None else run
    run.subscribe(Position())
    started = bool(_WATCH)
    _WATCH.update(cfg=cfg, interval=interval, run=run)
    if started:
        return
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


def record_failure(line: str) -> None:
    """This rank's one-line failure message, for the launcher (`launch/train_grpo.sh` sets JETRL_EXIT_DIR and
    repeats the first failing rank's line last, after torchrun's own report); nothing without JETRL_EXIT_DIR."""
    directory = os.environ.get("JETRL_EXIT_DIR")
    if not directory:
        return
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    try:
        Path(directory, f"rank{rank}.msg").write_text(line.strip().splitlines()[0] + "\n" if line.strip() else "")
    except OSError:
        pass


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


class Position:
    """Subscriber: the phase this rank entered is its position, written to $JETRL_EXIT_DIR/rank<R>.where (when set)."""

    def __init__(self):
        self.directory = os.environ.get("JETRL_EXIT_DIR")
        self.last = None

    def on_phase(self, run: RunContext, name: str) -> None:
        now = _position(_rank(), run.step, name)
        if not self.directory or now == self.last:
            return
        self.last = now
        try:
            path = Path(self.directory, f"rank{_rank()}.where")
            path.with_suffix(".tmp").write_text(now + "\n")
            os.replace(path.with_suffix(".tmp"), path)
        except OSError:
            pass


def _position(rank: int, step: int | None, phase: str | None) -> str:
    """`at step S (phase), pipeline stage X of P` (the parts that are known)."""
    here = f"at step {step}" + (f" ({phase})" if phase else "") if step is not None else (f"in {phase}" if phase else "")
    parts = [here, _stage(rank).strip(" ()")]
    return ", ".join(p.strip() for p in parts if p.strip())


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
        failed = {r: store.get(_key("failed", r)).decode(errors="replace") for r in others if store.check([_key("failed", r)])}
    except Exception as e:  # noqa: BLE001
        host = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return (
            None,
            {},
            f"the rendezvous store at {host} is unreachable ({type(e).__name__}): its host (rank 0 when started without torchrun) is lost",
        )
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


def _stage(rank: int) -> str:
    """` (pipeline stage S of P)` for a run with pipeline stages (megatron's default rank order: TP, then DP, then PP)."""
    cfg = _WATCH.get("cfg")
    if cfg is None or cfg.parallel.pp == 1:
        return ""
    return f" (pipeline stage {rank // (cfg.parallel.tp * cfg.parallel.dp)} of {cfg.parallel.pp})"


def report(exc: BaseException, tb=None) -> str:
    """Print (and return) the one-line account of why this rank stops."""
    cfg, run = _WATCH.get("cfg"), _WATCH.get("run")
    step, phase = (run.step, run.current) if run is not None else (None, None)
    me = _rank()
    first_line = (str(exc).strip().splitlines() or [""])[0]
    line = f"rank {me}{_stage(me)} failed" + (f" at step {step}" if step is not None else "") + (f" ({phase})" if phase else "")
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
            line += f"; lost rank(s) [{', '.join(f'{r}{_stage(r)}' for r in lost)}] (no heartbeat for {3 * _WATCH.get('interval', 1.0):.1f} s: killed, crashed or frozen)"
        if failed:
            line += "; " + "; ".join(f"rank {r} reported: {m}" for r, m in sorted(failed.items()))
        if note:
            line += f"; {note}"
    chain = _chain(exc)
    if any(type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower() for e in chain):  # torch's, vLLM's cumem
        line += (
            "; out of GPU memory: lower grpo.micro_batch_size (activations), rollout.kv_cache_fraction, "
            "rollout.kv_cache_gb or rollout.max_model_len (the engine's KV cache), free the actor's state while the "
            "engine is awake (rollout.offload), or spread the actor wider (parallel.tp, parallel.pp, optim.distributed)"
        )
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
            from megatron_jetrl.rl.checkpoints import latest_checkpoint

            ckpt = latest_checkpoint(cfg)
            line += f"; newest complete checkpoint: {ckpt} (a restart resumes there)" if ckpt else "; no complete checkpoint yet"
        except Exception:  # noqa: BLE001
            pass
    _say(line)
    record_failure(f"jetrl: {line}")
    return line
