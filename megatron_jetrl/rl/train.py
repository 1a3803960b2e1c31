"""GRPO with the Jet-RL precision flow: `python -m megatron_jetrl.rl.train [CONFIG.yaml ...] [section.key=value ...]`
(one process per rank; `bash launch/train_grpo.sh` starts torchrun for you). Config files compose left to right
(default configs/tiny.yaml), then the overrides, e.g. `run.steps=10 optim.lr=1e-4`; `python -m
megatron_jetrl.rl.config ARGS --print` shows every key. A run that is started again resumes from its newest
checkpoint (rl/run_state.py: already complete, or resumed with the changes it may take).

Each step: re-quantize + sync the actor's FP8 bytes to the engines -> rollout (native FP8 engines on rank 0, or vLLM on
every rank) -> rewards -> group advantages -> old/ref logprobs (actor) -> update -> metrics -> checkpoint. From the sync to
the end of the rollout the actor's gradients, optimizer state and FP8 weight copies may wait off the GPU
(rollout.offload).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_jetrl.rl.extras import require_train_extras

require_train_extras("megatron_jetrl.rl.train")  # a bare `pip install .`: one line naming what is missing, not a traceback

from megatron_jetrl.actor.logprobs import compute_logprobs, response_start  # noqa: E402
from megatron_jetrl.actor.parallel import from_last_stage, group_device
from megatron_jetrl.actor.train_step import NonFiniteError, train_step
from megatron_jetrl.actor.weight_stream import actor_weight_stream, drain
from megatron_jetrl.rl import faults, preflight, run_lock
from megatron_jetrl.rl import session as sess
from megatron_jetrl.rl.advantages import group_advantages
from megatron_jetrl.rl.config import ConfigError, load_config, sections_help, split_args
from megatron_jetrl.rl.data import format_prompt
from megatron_jetrl.rl.interrupt import Interrupts
from megatron_jetrl.rl.jit_cache import CompileProgress, cache_dirs
from megatron_jetrl.rl.loss import check_mask, policy_loss
from megatron_jetrl.rl.metrics import MetricsWriter, format_summary, progress, read_metrics, summarize
from megatron_jetrl.rl.profiling import StepProfiler
from megatron_jetrl.rl.rewards import compute_rewards
from megatron_jetrl.rl.rollout_batch import RolloutBatch, assemble, broadcast_batch, check_outputs
from megatron_jetrl.rl.warmup import warm_start
from megatron_jetrl.rollout.engine import SamplingParams
from megatron_jetrl.rollout.metrics import flat_metrics, length_means, mismatch_metrics
from megatron_jetrl.rollout.sampling import step_seed
from megatron_jetrl.rollout.sync import ALLOCATOR_STALLS, Phases


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(__doc__.strip() + "\n\n" + sections_help())
        return 0
    interrupts = Interrupts()  # Ctrl-C / SIGTERM: stop at the end of the step, checkpointed (rl/interrupt.py)
    interrupts.install()
    cfg = None
    try:  # a ConfigError (also one found once the process group exists: device, checkpoints) is a clean exit 2
        cfg = load_config(*split_args(args))
        previous = preflight.check(cfg)  # machine, inputs and run directory, before anything is written or started
        if previous is not None and previous.complete(cfg):
            if int(os.environ.get("RANK", "0")) == 0:
                print(previous.complete_message(cfg))
            interrupts.restore()
            return 0
        taken = run_lock.acquire(cfg.run.directory) if os.environ.get("RANK", "0") == "0" else None  # one run a directory
        sess.init_distributed(cfg)
        faults.watch(cfg)  # heartbeat + one-line failure report naming rank/step/phase
        if cfg.run.device_type() == "cuda" and int(os.environ["RANK"]) == 0:
            CompileProgress(cache_dirs(cfg.run.jit_cache_dir)).start()  # a cold machine compiles kernels: say so
        s = sess.build_session(cfg)
        state = sess.resume(s)
        if s.is_main:  # only now: a refused run leaves its directory as it was
            sess.write_config(cfg)
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
    start = state["step"] if state else 0
    interrupts.where = "the warm-start (SFT)" if state is None and cfg.warmup.steps else "start-up"
    if state is None:
        warm_start(s)
        sess.freeze_reference(s)
    if cfg.run.steps == 0:  # the warm-start alone: its checkpoint and export are what GRPO runs start from
        return finish(s, sess.save(s, 0, warmup_done=True) if cfg.run.checkpoint and state is None else None)
    if cfg.rollout.engine == "vllm":
        sess.start_vllm_pool(s)
    writer = MetricsWriter(cfg.run.directory, enabled=s.is_main, resume_step=start)
    bar = progress(cfg.run.steps - start, f"GRPO {cfg.precision.mode}", enabled=s.is_main)
    last_saved = None
    interrupts.graceful = True
    for step in range(start, cfg.run.steps):
        interrupts.where = f"GRPO step {step}"
        profiler = step_profiler(s, step)
        t = Phases(profiler=profiler, memory=True, unmapped=s.pool.engine.unmapped_bytes if colocated(s) else None)
        with t("sync"):
            stats = sync(s)  # the engines serve the policy this step samples
        held = heldout_metrics(s, step)  # that policy on problems it never trains on
        with t("rollout"):
            batch = rollout(s, step)
        mine = my_rows(batch, s.device)
        first = response_start(mine.mask)  # prompt positions get no logits
        with t("eval"):
            old = actor_logprobs(s, s.model, mine, first)
            ref = reference_logprobs(s, mine, first)
        with t("update"):
            update = update_policy(s, step, batch, mine, old, ref, first)
        row = {"step": step, **step_metrics(s, batch, mine, old, update), **t, **stats, **pool_metrics(s), **held,
               **memory_metrics(t)}
        row["time/step"] = sum(v for k, v in t.items())
        row["throughput/tokens_per_s"] = float(batch.response_lengths.sum()) / row["time/step"]
        if profiler is not None:
            row["profiled"] = 1
            report_profile(s, profiler)
        writer.write(row)
        bar.update(1, reward=f"{row['reward/mean']:.3f}", mismatch=f"{row.get('mismatch/mean_abs_diff', 0):.2g}")
        if cfg.run.checkpoint and (cfg.run.save_every and (step + 1) % cfg.run.save_every == 0 or step + 1 == cfg.run.steps):
            last_saved = sess.save(s, step + 1, warmup_done=True)
        if interrupts.stop_requested(group_device(None)):
            return stop(s, interrupts, step, last_saved, bar, writer)
    bar.close()
    writer.close()
    interrupts.restore()
    return finish(s, last_saved)


def stop(s, interrupts: Interrupts, step: int, last_saved, bar, writer) -> int:
    """The run stops after `step` on a signal (every rank agreed): checkpointed there, said in one line; the exit code
    (`Interrupts.announce`)."""
    cfg = s.cfg
    bar.close()
    writer.close()
    if cfg.run.checkpoint and (last_saved is None or last_saved.name != f"step_{step + 1:06d}"):
        last_saved = sess.save(s, step + 1, warmup_done=True)
    saved = (f"checkpoint {last_saved}: a restart resumes at step {step + 1} of {cfg.run.steps}" if cfg.run.checkpoint
             else "run.checkpoint=false: nothing saved, a restart begins anew")
    dist.barrier()
    faults.leave_together()
    interrupts.restore()
    return interrupts.announce(f"stopped at the end of GRPO step {step}; {saved}")


def finish(s, last_saved) -> int:
    """The export (run.export) of the newest checkpoint, summary.json and the summary table."""
    cfg = s.cfg
    if cfg.run.export:
        sess.export(s, last_saved or sess.latest_checkpoint(cfg))
    if s.is_main:
        rows = read_metrics(cfg.run.directory / "metrics.jsonl")
        (cfg.run.directory / "summary.json").write_text(json.dumps(summarize(rows), indent=1))
        print(format_summary(rows))
    dist.barrier()
    faults.leave_together()
    run_lock.release(cfg.run.directory)
    return 0


def rollout(s, step: int) -> RolloutBatch:
    """n completions per prompt (rank 0's native pool, or every rank's colocated engine for its share); rank 0 scores
    them and broadcasts the batch to every rank."""
    cfg = s.cfg
    problems = s.sampler.next_batch()  # every rank advances its sampler: its state is checkpointed
    batch = None
    prompts = [s.tokenizer.encode(format_prompt(p, cfg.data.template)) for p in problems]
    sampling = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_new_tokens, seed=step_seed(cfg.run.seed, step))
    if s.pool is not None:  # rank 0's native pool, or a colocated pool on every rank (collective)
        outputs = s.pool.generate(prompts, sampling)
        if colocated(s):
            s.pool.sleep()  # the GPU is the actor's until the next sync
    if s.offload is not None:
        s.offload.restore()
    if s.is_main:
        check_outputs(outputs, cfg.rollout.n, s.arch.vocab_size)
        texts = [c.text if c.text is not None else s.tokenizer.decode(c.token_ids) for o in outputs for c in o.completions]
        golds = [p.answer for p in problems for _ in range(cfg.rollout.n)]
        rewards = compute_rewards(texts, golds, cfg.data.reward_style)
        advantages = group_advantages(torch.tensor(rewards), cfg.rollout.n, scale=cfg.grpo.advantage_scale)
        batch = assemble(prompts, outputs, rewards, advantages, s.tokenizer.pad_id)
    return broadcast_batch(batch)


def heldout_metrics(s, step: int) -> dict:
    """Greedy accuracy on the held-out problems every run.eval_every steps and at the last step (on rank 0; every
    rank of a colocated pool generates its share): overall, per response-length bucket, response length; {} else."""
    cfg = s.cfg
    if not cfg.run.eval_every or step % cfg.run.eval_every and step != cfg.run.steps - 1:
        return {}
    start = time.perf_counter()
    if s.pool is not None:
        prompts = [s.tokenizer.encode(format_prompt(p, cfg.data.template)) for p in s.heldout]
        outputs = s.pool.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens))
    if not s.is_main:
        return {}
    answers = [o.completions[0] for o in outputs]
    rewards = torch.tensor(compute_rewards([c.text if c.text is not None else s.tokenizer.decode(c.token_ids) for c in answers],
                                           [p.answer for p in s.heldout], cfg.data.reward_style))
    lengths = torch.tensor([len(c.token_ids) for c in answers])
    return {"heldout/accuracy": float(rewards.double().mean()), "heldout/response_length": float(lengths.double().mean()),
            "heldout/truncated_frac": sum(c.finish_reason == "length" for c in answers) / len(answers),
            **length_means(rewards, lengths, "heldout/accuracy/"), "time/heldout": time.perf_counter() - start}


def my_rows(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """This data-parallel rank's contiguous share of the batch."""
    from megatron.core import parallel_state as ps

    per = len(batch) // ps.get_data_parallel_world_size()
    rank = ps.get_data_parallel_rank()
    return batch.rows(rank * per, (rank + 1) * per).to(device)


def actor_logprobs(s, model, batch: RolloutBatch, first: torch.Tensor | None = None) -> torch.Tensor:
    return compute_logprobs(model, batch.tokens, vocab_size=s.arch.vocab_size, micro_batch_size=s.cfg.grpo.logprob_batch,
                            first=first)


def reference_logprobs(s, batch: RolloutBatch, first: torch.Tensor | None = None) -> torch.Tensor | None:
    """The frozen reference's logprobs (loss.kl_coef > 0; under rollout.offload=optimizer its FP8 bytes are back from
    host memory first), or None without a reference."""
    if s.reference is None:
        return None
    if s.offload is not None:
        s.offload.wait(reference=True)
    return actor_logprobs(s, s.reference, batch, first)


def update_policy(s, step: int, batch: RolloutBatch, mine: RolloutBatch, old: torch.Tensor, ref: torch.Tensor | None,
                  first: torch.Tensor | None = None) -> dict:
    """`updates_per_step` optimizer steps over equal chunks of this rank's rows `mine` (1: fully on-policy).

    NaN/Inf in the rewards (of the whole `batch`: every rank sees the same), the loss or the gradients: the run
    stops with a NonFiniteError naming step, rank or completion, and tensor (run.on_nonfinite=stop), or the
    update is skipped, said in one line on rank 0 and in the metrics (`skip`)."""
    cfg = s.cfg
    if s.offload is not None:
        s.offload.wait()  # the optimizer state's copy back (it overlapped the logprob passes)
    bad = torch.nonzero(~torch.isfinite(batch.rewards)).flatten().tolist()
    if bad:
        i = bad[0]
        where = (f"non-finite reward {batch.rewards[i].item()} of completion {i} (prompt {i // cfg.rollout.n}, sample "
                 f"{i % cfg.rollout.n}; {len(bad)} non-finite reward(s) in all): check the reward function")
        nonfinite(s, step, where)
        return {"ok": False, "grad_norm": None, "skipped": where, "skipped_updates": cfg.grpo.updates_per_step}

    check_mask(mine.mask, cfg.loss.agg, rows_per_loss=cfg.grpo.micro_batch_size)  # once, not per micro-batch

    def loss_fn(logprobs, extras):
        return policy_loss(logprobs, extras["old"], extras["adv"], extras["mask"], cfg=cfg.loss,
                           ref_logprobs=extras.get("ref"), rollout_logprobs=extras["rollout"], checked=True)

    extras = {"adv": mine.advantages, "mask": mine.mask, "rollout": mine.rollout_logprobs}
    if old is not None:  # None on a pipeline stage without the output layer, which computes no loss
        extras["old"] = old
    if ref is not None:
        extras["ref"] = ref
    if first is not None:
        extras["first"] = first  # CPU: each micro-batch's logits start at its first response column
    chunk = len(mine) // cfg.grpo.updates_per_step
    results = []
    for u in range(cfg.grpo.updates_per_step):
        rows = slice(u * chunk, (u + 1) * chunk)
        result = train_step(s.model, s.optimizer, mine.tokens[rows], loss_fn, vocab_size=s.arch.vocab_size,
                            micro_batch_size=cfg.grpo.micro_batch_size, extras={k: v[rows] for k, v in extras.items()},
                            on_nonfinite="skip")
        result = from_last_stage(result)  # the loss terms exist on the last pipeline stage only
        if "skipped" in result:
            nonfinite(s, step, result["skipped"])
        results.append(result)
    skipped = [r["skipped"] for r in results if "skipped" in r]
    return results[-1] | {"skipped_updates": sum(not r["ok"] for r in results), "skipped": "; ".join(skipped) or None}


def step_profiler(s, step: int) -> StepProfiler | None:
    """The profiler of step `step` when it is `run.profile_step` (every rank profiles its own phases)."""
    if step != s.cfg.run.profile_step:
        return None
    return StepProfiler(step, s.cfg.run.profiled_phases(), s.cfg.run.directory, dist.get_rank(), s.device)


def report_profile(s, profiler: StepProfiler) -> None:
    path = profiler.write()
    if s.is_main:
        print(f"profile of step {profiler.step} (rank 0; every rank's JSON beside {path}):\n{profiler.table()}", file=sys.stderr)


def nonfinite(s, step: int, where: str) -> None:
    """run.on_nonfinite for a NaN/Inf found at `where`: raise NonFiniteError (stop), or say on rank 0 that the
    update is skipped (skip)."""
    if s.cfg.run.on_nonfinite == "stop":
        raise NonFiniteError(f"step {step}: {where}; the update was not applied and the run stops "
                             "(run.on_nonfinite=skip skips such updates instead)")
    if s.is_main:
        print(f"step {step}: update skipped: {where}", file=sys.stderr, flush=True)


def colocated(s) -> bool:
    """Engines on every rank (vLLM): rollout and sync are collective, and the engine sleeps while the actor trains."""
    return getattr(s.pool, "colocated", False)


def sync(s) -> dict:
    """Re-quantized FP8 bytes (or BF16) of the actor -> every engine, bucketed; time and bytes on rank 0. The actor's
    training state leaves the GPU first, its FP8 weight copies once streamed (rollout.offload: the engine wakes into
    that memory)."""
    pairs = actor_weight_stream(s.model, s.arch, s.flow, to="all" if colocated(s) else "rank0")
    if s.offload is not None:
        s.offload.release()
        pairs = s.offload.streamed(pairs)
    if s.pool is None:
        drain(pairs)
        stats = {}
    else:
        stats = s.pool.sync(pairs).as_metrics()
    if s.offload is not None:
        stats |= {"sync/offload_gib": s.offload.freed["state"] / 2**30, "sync/fp8_dropped_gib": s.offload.freed["fp8"] / 2**30}
    return stats


def memory_metrics(t: Phases) -> dict:
    """GPU memory of the step's phases, the most on any rank (collective): `memory/<phase>_gib`, what torch's caching
    allocator had allocated at its peak in that phase (GiB; the colocated engine's weights and KV cache while they are
    mapped included, not while the engine sleeps: `Phases`), `memory/reserved_gib`, the most it held from the device
    in the step, and `memory/<phase>_<stall>` for each of `ALLOCATOR_STALLS` (retries after freeing the cache, cudaFree
    calls: each synchronizes the device; where the update's are not 0, memory is near full and the host waits for the
    GPU); {} off CUDA."""
    if not t.peaks:
        return {}
    names = list(t.peaks)
    stalls = [f"memory/{n}_{kind}" for n in names for kind in ALLOCATOR_STALLS]
    values = torch.tensor([t.peaks[n][0] / 2**30 for n in names] + [max(r for _, r in t.peaks.values()) / 2**30]
                          + [float(v) for n in names for v in t.stalls.get(n, (0,) * len(ALLOCATOR_STALLS))],
                          dtype=torch.float64, device=group_device(None))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    keys = [f"memory/{n}_gib" for n in names] + ["memory/reserved_gib"] + stalls
    return {k: int(v) if k in stalls else v for k, v in zip(keys, values.tolist())}


def pool_metrics(s) -> dict:
    """The colocated engine's sleep (inside the rollout phase): seconds, and the GiB it released; the sequences rank 0's
    engine holds at their full length (`rollout/fit_at_once`) and the ones vLLM preempted in this step's rollout, the
    most on any rank (`rollout/preemptions`: each is recomputed from its tokens so far)."""
    if not colocated(s) or s.pool.sleep_seconds is None:
        return {}
    out = {"rollout/sleep_s": s.pool.sleep_seconds, "rollout/sleep_released_gib": (s.pool.wake_bytes or 0) / 2**30}
    if s.pool.at_once:
        out["rollout/fit_at_once"] = s.pool.at_once
    if s.pool.preemptions is not None:
        most = torch.tensor([s.pool.preemptions], dtype=torch.float64, device=group_device(None))
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        out["rollout/preemptions"] = int(most.item())
    return out


def step_metrics(s, batch: RolloutBatch, mine: RolloutBatch, old: torch.Tensor, update: dict) -> dict:
    """Reward, length, loss terms and the train/rollout mismatch (old logprobs vs the engine's, response tokens):
    overall and per response-length bucket (`mismatch/len<lo>-<hi>/*`, rollout.metrics; the reward too: `reward/len<lo>-<hi>`)."""
    from megatron.core import parallel_state as ps

    mask = mine.mask.bool().cpu()
    ours = None if old is None else (  # old: on the last pipeline stage only
        [lp[m].tolist() for lp, m in zip(old.cpu(), mask)], [lp[m].tolist() for lp, m in zip(mine.rollout_logprobs.cpu(), mask)])
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ours))
    shares = [rows for tp_rank, _, rows in sorted(shares, key=lambda x: x[1]) if tp_rank == 0 and rows is not None]  # one per DP rank
    train = [row for trained, _ in shares for row in trained]
    roll = [row for _, rolled in shares for row in rolled]
    out = {
        "mode": s.flow.mode, "tp": s.cfg.parallel.tp, "pp": s.cfg.parallel.pp, "dp": s.cfg.parallel.dp,
        "rollout_engine": s.cfg.rollout.engine, "rollout_tp": s.cfg.rollout.tp,
        "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std(unbiased=False)),
        "response_length/mean": float(batch.response_lengths.float().mean()),
        "response_length/truncated_frac": float(batch.truncated.float().mean()),
        "grad_norm": update.get("grad_norm"), "loss/total": update.get("loss"), "loss/pg": update.get("pg_loss"),
        "loss/kl": update.get("kl"), "loss/clip_frac": update.get("clip_frac"), "skipped_updates": update["skipped_updates"],
        "skipped": update["skipped"],
        **length_means(batch.rewards, batch.response_lengths, "reward/"),
    }
    mm = mismatch_metrics(train, roll, tis_cap=s.cfg.loss.tis_cap or 2.0)
    return out | {k: v for k, v in flat_metrics(mm).items() if "/pos" not in k}


if __name__ == "__main__":
    sys.exit(main())
