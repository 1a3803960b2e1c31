"""GRPO with the Jet-RL precision flow: `python -m megatron_jetrl.rl.train [CONFIG.yaml ...] [section.key=value ...]`
(one process per rank; `bash launch/train_grpo.sh` starts torchrun for you). Config files compose left to right
(default configs/tiny.yaml), then the overrides, e.g. `run.steps=10 optim.lr=1e-4`; `python -m
megatron_jetrl.rl.config ARGS --print` shows every key. A run that is started again resumes from its newest
checkpoint (rl/run_state.py: already complete, or resumed with the changes it may take).

Each step (rl/step.py): re-quantize + sync the actor's FP8 bytes to the engines -> rollout (native FP8 engines on rank 0,
or vLLM on every rank) -> rewards and group advantages of each rank's own rows -> old/ref logprobs (actor) -> update ->
metrics -> checkpoint. From the sync to the end of the rollout the actor's gradients, optimizer state and FP8 weight
copies may wait off the GPU (rollout.offload). Each part is a phase of the run context (rl/context.py), which the
failure report, the profiler, the metrics file and plugins (JETRL_PLUGINS) watch.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from megatron_jetrl.rl.extras import require_train_extras

require_train_extras("megatron_jetrl.rl.train")  # a bare `pip install .`: one line naming what is missing, not a traceback

from megatron_jetrl.actor.logprobs import response_start  # noqa: E402
from megatron_jetrl.actor.parallel import group_device
from megatron_jetrl.rl import checkpoints, faults, preflight, run_lock
from megatron_jetrl.rl import session as sess
from megatron_jetrl.rl.config import ConfigError, load_config, sections_help, split_args
from megatron_jetrl.rl.context import RunContext
from megatron_jetrl.rl.interrupt import Interrupts
from megatron_jetrl.rl.jit_cache import CompileProgress, cache_dirs
from megatron_jetrl.rl.metrics import MetricsWriter, format_summary, progress, read_metrics, summarize
from megatron_jetrl.rl.profiling import StepProfiler
from megatron_jetrl.rl.rendezvous import leave_together
from megatron_jetrl.rl.sft import sft_warm_start
from megatron_jetrl.rl.step import (
    actor_logprobs,
    heldout_metrics,
    memory_metrics,
    reference_logprobs,
    rollout,
    step_metrics,
    sync,
    update_policy,
)
from megatron_jetrl.rollout.sync import Phases


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(__doc__.strip() + "\n\n" + sections_help())
        return 0
    run = RunContext()
    interrupts = Interrupts(run)  # Ctrl-C / SIGUSR1: stop at the end of the step, checkpointed (rl/interrupt.py)
    interrupts.install()
    started = start_up(args, run, interrupts)
    if isinstance(started, int):
        return started
    s, state = started
    cfg = s.cfg
    start = state["step"] if state else 0
    if state is None:
        with run.phase("warm-start"):
            sft_warm_start(s)
            sess.freeze_reference(s)
    if cfg.run.steps == 0:  # the warm-start alone: its checkpoint and export are what GRPO runs start from
        return finish(s, checkpoints.save(s, 0, warmup_done=True) if cfg.run.checkpoint and state is None else None)
    with run.phase("start-up"):
        sess.start_pool(s)
    if cfg.run.profile_step is not None:  # first: it marks the row the others write
        run.subscribe(
            StepProfiler(
                cfg.run.profile_step, cfg.run.profiled_phases(), cfg.run.directory, dist.get_rank(), s.device, announce=s.is_main
            )
        )
    run.subscribe(MetricsWriter(cfg.run.directory, enabled=s.is_main, resume_step=start))
    run.subscribe(progress(cfg.run.steps - start, f"GRPO {cfg.precision.mode}", enabled=s.is_main))
    last_saved = None
    interrupts.graceful = True
    for step in range(start, cfg.run.steps):
        run.step = step
        t = Phases(around=run.phase, memory=True, unmapped=s.pool.unmapped_bytes)
        with t("sync"):
            stats = sync(s)  # the engines serve the policy this step samples
        with run.phase("heldout"):
            held = heldout_metrics(s, step)  # that policy on problems it never trains on
        with t("rollout"):
            mine, outcome = rollout(s, step)
        first = response_start(mine.mask)  # prompt positions get no logits
        with t("eval"):
            old = actor_logprobs(s, s.model, mine, first)
            ref = reference_logprobs(s, mine, first)
        with t("update"):
            update = update_policy(s, step, outcome, mine, old, ref, first)
        with run.phase("metrics"):
            row = {
                "step": step,
                **step_metrics(s, outcome, mine, old, update),
                **t,
                **stats,
                **s.pool.metrics(),
                **held,
                **memory_metrics(t),
            }
            row["time/step"] = sum(v for k, v in t.items())
            row["throughput/tokens_per_s"] = float(outcome.response_lengths.sum()) / row["time/step"]
            run.end_step(row)  # the metrics file, the progress bar, the profiler's report
        if cfg.run.checkpoint and (cfg.run.save_every and (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.run.steps):
            with run.phase("save"):
                last_saved = checkpoints.save(s, step + 1, warmup_done=True)
        if interrupts.stop_requested(group_device(None)):
            return stop(s, interrupts, step, last_saved)
    run.end()  # the metrics file and the progress bar close
    interrupts.restore()
    return finish(s, last_saved)


def start_up(args: list[str], run: RunContext, interrupts: Interrupts):
    """The config, the preflight, the process group, the failure watch and the session, resumed from the newest
    checkpoint: `(session, resumed state or None)`, or the exit code of a run that ends here (0: already complete,
    2: a ConfigError, also one found once the process group exists: device, checkpoints)."""
    cfg = None
    try:
        with run.phase("start-up"):
            cfg = load_config(*split_args(args))
            previous = preflight.check(cfg)  # machine, inputs and run directory, before anything is written or started
            if previous is not None and previous.complete(cfg):
                if int(os.environ.get("RANK", "0")) == 0:
                    print(previous.complete_message(cfg))
                interrupts.restore()
                return 0
            taken = run_lock.acquire(cfg.run.directory) if os.environ.get("RANK", "0") == "0" else None  # one run a directory
            sess.init_distributed(cfg)
            faults.watch(cfg, run)  # heartbeat + one-line failure report naming rank/step/phase
            run.load_plugins()
            if cfg.run.device_type() == "cuda" and int(os.environ["RANK"]) == 0:
                CompileProgress(cache_dirs(cfg.run.jit_cache_dir)).start()  # a cold machine compiles kernels: say so
            s = sess.build_session(cfg, run)
            state = checkpoints.resume(s)
            if s.is_main:  # only now: a refused run leaves its directory as it was
                checkpoints.write_config(cfg)
                if previous is not None:
                    print(previous.resume_message(cfg), file=sys.stderr)
                if taken:
                    print(f"note: {taken}", file=sys.stderr)
                for notice in cfg.notices():
                    print(f"note: {notice}", file=sys.stderr)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        faults.record_failure(f"config error: {e}")
        if cfg is not None:
            run_lock.release(cfg.run.directory)
        interrupts.restore()
        return 2
    return s, state


def stop(s, interrupts: Interrupts, step: int, last_saved) -> int:
    """The run stops after `step` on a signal (every rank agreed): checkpointed there, said in one line; the exit code
    (`Interrupts.announce`)."""
    cfg, run = s.cfg, s.run
    run.end()
    with run.phase("stop"):
        if cfg.run.checkpoint and (last_saved is None or last_saved.name != f"step_{step + 1:06d}"):
            last_saved = checkpoints.save(s, step + 1, warmup_done=True)
        saved = (
            f"checkpoint {last_saved}: a restart resumes at step {step + 1} of {cfg.run.steps}"
            if cfg.run.checkpoint
            else "run.checkpoint=false: nothing saved, a restart begins anew"
        )
        dist.barrier()
        leave_together()
    interrupts.restore()
    return interrupts.announce(f"stopped at the end of GRPO step {step}; {saved}")


def finish(s, last_saved) -> int:
    """The export (run.export) of the newest checkpoint, summary.json and the summary table."""
    cfg = s.cfg
    if cfg.run.export:
        with s.run.phase("export"):
            checkpoints.export(s, last_saved or checkpoints.latest_checkpoint(cfg))
    if s.is_main:
        rows = read_metrics(cfg.run.directory / "metrics.jsonl")
        (cfg.run.directory / "summary.json").write_text(json.dumps(summarize(rows), indent=1))
        print(format_summary(rows))
        print(f"  run directory    {cfg.run.directory}: {', '.join(written(cfg.run.directory))}")
    dist.barrier()
    leave_together()
    run_lock.release(cfg.run.directory)
    return 0


def written(directory) -> list[str]:
    """What a finished run leaves in its directory, in the order the README's "Run directory" lists it."""
    names = ("metrics.jsonl", "tb/", "checkpoints/", "export/", "summary.json", "config.yaml")
    return [name for name in names if (directory / name.rstrip("/")).exists()]


if __name__ == "__main__":
    sys.exit(main())
