"""The phases of one GRPO step, as rl/train.py's loop calls them: sync, rollout (with the rewards and advantages of
this rank's rows), the actor's and the reference's logprobs, the update, and the step's metrics.

Data: every rank gets the step's outputs from the pool (`TrainerPool.generate`), checks all of them, and scores
only the prompts of its own rows (a data-parallel rank's contiguous share; rewards are deterministic, so nothing
scored is sent). What the metrics need of the whole step goes as tensors: the rewards (one all-gather over the
data-parallel group) and the logprobs of the mismatch metrics (one all-gather on the last pipeline stage).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from megatron_jetrl.actor.logprobs import compute_logprobs
from megatron_jetrl.actor.parallel import from_last_stage, group_device
from megatron_jetrl.actor.train_step import NonFiniteError, train_step
from megatron_jetrl.actor.weight_stream import actor_weight_stream
from megatron_jetrl.grpo.advantages import group_advantages
from megatron_jetrl.grpo.batch import RolloutBatch, StepOutcome, assemble, check_outputs, response_aligned
from megatron_jetrl.grpo.data import format_prompt
from megatron_jetrl.grpo.loss import check_mask, policy_loss
from megatron_jetrl.grpo.rewards import compute_rewards
from megatron_jetrl.rl import kv_scales
from megatron_jetrl.rollout.engine import SamplingParams
from megatron_jetrl.rollout.metrics import flat_metrics, length_means, mismatch_metrics
from megatron_jetrl.rollout.sampling import step_seed
from megatron_jetrl.rollout.sync import ALLOCATOR_STALLS, Phases


def sync(s) -> dict:
    """Re-quantized FP8 bytes (or BF16) of the actor -> the engines, bucketed; time and bytes. With the trainer's FP8
    KV cache scales, the next ones are decided first and ship with the weights. The actor's training state leaves the
    GPU first, its FP8 weight copies once streamed (rollout.offload: the engine wakes into that memory)."""
    scales = {}
    if s.kv_scales is not None:  # the FP8 KV cache's next scales, into the actor (and the reference) before they stream
        s.kv_scales = kv_scales.refresh(s.model, s.flow.kv_scale_policy, s.kv_scales)
        if s.reference is not None:
            kv_scales.apply(s.reference, s.kv_scales)
        scales = kv_scales.scale_metrics(s.kv_scales)
    pairs = actor_weight_stream(s.model, s.arch, s.flow, to=s.pool.weight_target)
    if s.offload is not None:
        s.offload.release()
        pairs = s.offload.streamed(pairs)
    stats = s.pool.sync(pairs).as_metrics() | scales
    if s.offload is not None:
        stats |= {"sync/offload_gib": s.offload.freed["state"] / 2**30, "sync/fp8_dropped_gib": s.offload.freed["fp8"] / 2**30}
    return stats


def my_rows(count: int) -> tuple[int, int]:
    """This data-parallel rank's contiguous `[start, end)` share of the step's `count` sequences."""
    from megatron.core import parallel_state as ps

    per = count // ps.get_data_parallel_world_size()
    rank = ps.get_data_parallel_rank()
    return rank * per, (rank + 1) * per


def rollout(s, step: int) -> tuple[RolloutBatch, StepOutcome]:
    """n completions per prompt from the pool (collective); this rank's rows as tensors on its device, with their
    rewards and group advantages, and the step's outcome (every reward, length and truncation)."""
    cfg, n = s.cfg, s.cfg.rollout.n
    problems = s.sampler.next_batch()  # every rank advances its sampler: its state is checkpointed
    prompts = [s.tokenizer.encode(format_prompt(p, cfg.data.template)) for p in problems]
    sampling = SamplingParams(
        n=n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=step_seed(cfg.run.seed, step),
    )
    outputs = s.run.tap("outputs", s.pool.generate(prompts, sampling))
    s.pool.sleep()  # the GPU is the actor's until the next sync
    if s.offload is not None:
        s.offload.restore()
    check_outputs(outputs, n, s.arch.vocab_size)  # every rank checks all: a broken engine stops all of them at once
    start, end = my_rows(len(prompts) * n)
    first, last = start // n, -(-end // n)  # the prompts (groups) my rows belong to
    texts = [
        c.text if c.text is not None else s.tokenizer.decode(c.token_ids) for o in outputs[first:last] for c in o.completions
    ]
    rewards = s.run.tap(
        "rewards", compute_rewards(texts, [p.answer for p in problems[first:last] for _ in range(n)], cfg.data.reward_style)
    )
    advantages = group_advantages(torch.tensor(rewards), n, scale=cfg.grpo.advantage_scale)
    width = max(len(p) + len(c.token_ids) for p, o in zip(prompts, outputs) for c in o.completions)
    mine = assemble(prompts[first:last], outputs[first:last], rewards, advantages, s.tokenizer.pad_id, width=width)
    mine = mine.rows(start - first * n, end - first * n)
    return mine.to(s.device), StepOutcome.of(outputs, all_rewards(mine.rewards))


def all_rewards(mine: torch.Tensor) -> torch.Tensor:
    """The step's rewards in row order, from each data-parallel rank's (one all-gather)."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return mine
    device = group_device(group)
    parts = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine.to(device), group=group)
    return torch.cat(parts).cpu()


def heldout_metrics(s, step: int) -> dict:
    """Greedy accuracy on the held-out problems every run.eval_every steps and at the last step (collective; rank 0
    scores): overall, per response-length bucket, response length; {} else."""
    cfg = s.cfg
    if not cfg.run.eval_every or step % cfg.run.eval_every and step != cfg.run.steps - 1:
        return {}
    start = time.perf_counter()
    prompts = [s.tokenizer.encode(format_prompt(p, cfg.data.template)) for p in s.heldout]
    outputs = s.pool.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens))
    if not s.is_main:
        return {}
    answers = [o.completions[0] for o in outputs]
    rewards = torch.tensor(
        compute_rewards(
            [c.text if c.text is not None else s.tokenizer.decode(c.token_ids) for c in answers],
            [p.answer for p in s.heldout],
            cfg.data.reward_style,
        )
    )
    lengths = torch.tensor([len(c.token_ids) for c in answers])
    return {
        "heldout/accuracy": float(rewards.double().mean()),
        "heldout/response_length": float(lengths.double().mean()),
        "heldout/truncated_frac": sum(c.finish_reason == "length" for c in answers) / len(answers),
        **length_means(rewards, lengths, "heldout/accuracy/"),
        "time/heldout": time.perf_counter() - start,
    }


def actor_logprobs(s, model, batch: RolloutBatch, first: torch.Tensor | None = None) -> torch.Tensor:
    return compute_logprobs(
        model, batch.tokens, vocab_size=s.arch.vocab_size, micro_batch_size=s.cfg.grpo.logprob_batch, first=first
    )


def reference_logprobs(s, batch: RolloutBatch, first: torch.Tensor | None = None) -> torch.Tensor | None:
    """The frozen reference's logprobs (loss.kl_coef > 0; under rollout.offload=optimizer its FP8 bytes are back from
    host memory first), or None without a reference."""
    if s.reference is None:
        return None
    if s.offload is not None:
        s.offload.wait(reference=True)
    return actor_logprobs(s, s.reference, batch, first)


def update_policy(
    s,
    step: int,
    outcome: StepOutcome,
    mine: RolloutBatch,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    first: torch.Tensor | None = None,
) -> dict:
    """`updates_per_step` optimizer steps over equal chunks of this rank's rows `mine` (1: fully on-policy).

    NaN/Inf in the rewards (of the whole step: every rank sees the same), the loss or the gradients: the run stops
    with a NonFiniteError naming step, rank or completion, and tensor (run.on_nonfinite=stop), or the update is
    skipped, said in one line on rank 0 and in the metrics (`skip`)."""
    cfg = s.cfg
    if s.offload is not None:
        s.offload.wait()  # the optimizer state's copy back (it overlapped the logprob passes)
    bad = torch.nonzero(~torch.isfinite(outcome.rewards)).flatten().tolist()
    if bad:
        i = bad[0]
        where = (
            f"non-finite reward {outcome.rewards[i].item()} of completion {i} (prompt {i // cfg.rollout.n}, sample "
            f"{i % cfg.rollout.n}; {len(bad)} non-finite reward(s) in all): check the reward function"
        )
        nonfinite(s, step, where)
        return {"ok": False, "grad_norm": None, "skipped": where, "skipped_updates": cfg.grpo.updates_per_step}

    check_mask(mine.mask, cfg.loss.agg, rows_per_loss=cfg.grpo.micro_batch_size)  # once, not per micro-batch

    def loss_fn(logprobs, extras):
        loss, terms = policy_loss(
            s.run.tap("logprobs", logprobs),
            extras["old"],
            extras["adv"],
            extras["mask"],
            cfg=cfg.loss,
            ref_logprobs=extras.get("ref"),
            rollout_logprobs=extras["rollout"],
            checked=True,
        )
        return s.run.tap("loss", loss), terms

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
        result = train_step(
            s.model,
            s.optimizer,
            mine.tokens[rows],
            loss_fn,
            vocab_size=s.arch.vocab_size,
            micro_batch_size=cfg.grpo.micro_batch_size,
            extras={k: v[rows] for k, v in extras.items()},
            on_nonfinite="skip",
        )
        result = from_last_stage(result)  # the loss terms exist on the last pipeline stage only
        if "skipped" in result:
            nonfinite(s, step, result["skipped"])
        results.append(result)
    skipped = [r["skipped"] for r in results if "skipped" in r]
    return results[-1] | {"skipped_updates": sum(not r["ok"] for r in results), "skipped": "; ".join(skipped) or None}


def nonfinite(s, step: int, where: str) -> None:
    """run.on_nonfinite for a NaN/Inf found at `where`: raise NonFiniteError (stop), or say on rank 0 that the
    update is skipped (skip)."""
    if s.cfg.run.on_nonfinite == "stop":
        raise NonFiniteError(
            f"step {step}: {where}; the update was not applied and the run stops "
            "(run.on_nonfinite=skip skips such updates instead)"
        )
    if s.is_main:
        print(f"step {step}: update skipped: {where}", file=sys.stderr, flush=True)


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
    values = torch.tensor(
        [t.peaks[n][0] / 2**30 for n in names]
        + [max(r for _, r in t.peaks.values()) / 2**30]
        + [float(v) for n in names for v in t.stalls.get(n, (0,) * len(ALLOCATOR_STALLS))],
        dtype=torch.float64,
        device=group_device(None),
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    keys = [f"memory/{n}_gib" for n in names] + ["memory/reserved_gib"] + stalls
    return {k: int(v) if k in stalls else v for k, v in zip(keys, values.tolist())}


def step_metrics(s, outcome: StepOutcome, mine: RolloutBatch, old: torch.Tensor | None, update: dict) -> dict:
    """Reward, length, loss terms and the train/rollout mismatch (old logprobs vs the engine's, response tokens):
    overall and per response-length bucket (`mismatch/len<lo>-<hi>/*`, rollout.metrics; the reward too:
    `reward/len<lo>-<hi>`). Collective."""
    out = {
        "mode": s.flow.mode,
        "tp": s.cfg.parallel.tp,
        "pp": s.cfg.parallel.pp,
        "dp": s.cfg.parallel.dp,
        "rollout_engine": s.cfg.rollout.engine,
        "rollout_tp": s.cfg.rollout.tp,
        "reward/mean": float(outcome.rewards.mean()),
        "reward/std": float(outcome.rewards.std(unbiased=False)),
        "response_length/mean": float(outcome.response_lengths.float().mean()),
        "response_length/truncated_frac": float(outcome.truncated.float().mean()),
        "grad_norm": update.get("grad_norm"),
        "loss/total": update.get("loss"),
        "loss/pg": update.get("pg_loss"),
        "loss/kl": update.get("kl"),
        "loss/clip_frac": update.get("clip_frac"),
        "skipped_updates": update["skipped_updates"],
        "skipped": update["skipped"],
        **length_means(outcome.rewards, outcome.response_lengths, "reward/"),
    }
    return out | mismatch_row(s, outcome, mine, old)


def mismatch_row(s, outcome: StepOutcome, mine: RolloutBatch, old: torch.Tensor | None) -> dict:
    """`mismatch/*` of the whole step: on the last pipeline stage (which holds `old`) each data-parallel rank's
    response tokens, left-aligned, are all-gathered as tensors; the other stages get the row from it."""
    from megatron.core import parallel_state as ps

    row = None
    if old is not None:
        width = int(outcome.response_lengths.max())
        ours, theirs, mask = response_aligned(old, mine.rollout_logprobs, mine.mask, width=width)
        group = ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            device = group_device(group)
            gathered = []
            for x in (ours, theirs, mask):
                parts = [torch.empty_like(x, device=device) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, x.to(device), group=group)
                gathered.append(torch.cat(parts).cpu())
            ours, theirs, mask = gathered
        mm = mismatch_metrics(ours, theirs, mask.bool(), tis_cap=s.cfg.loss.tis_cap or 2.0)
        row = {k: v for k, v in flat_metrics(mm).items() if "/pos" not in k}
    return from_last_stage(row)
