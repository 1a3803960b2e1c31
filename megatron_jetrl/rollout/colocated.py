"""The colocated SPMD rollout pool: one vLLM engine per torchrun rank, as verl and NeMo-RL run it.

Rank layout: `rollout_tp` consecutive global ranks form one vLLM engine (its TP group; vLLM's external
launcher builds the same groups from the trainer's process group), so there are `world / rollout_tp` rollout
data-parallel groups. `generate` is collective: every rank passes the whole prompt list; rollout group `g`
generates the contiguous share `shard_bounds(len(prompts), groups)[g]` with the global request seeds of those
prompts (every TP rank of a group the same prompts and seeds, as vLLM's SPMD mode requires), and the outputs
of each group's first rank are all-gathered, so every rank returns the same list in prompt order -- the same
completions a single engine would sample for the same seeds. An engine that raises is reported through the same
all-gather: every rank raises at once, naming the rank and the error (an engine whose TP peers hang inside vLLM's own
collectives is left to the run's collective timeout and failure report).

Pipeline stages (parallel.pp > 1): every engine still holds the whole model at rollout.tp. The actor's stages split
the layers to fit what training holds (activations, gradients, optimizer state); an engine holds weights and KV cache
only, and a vLLM pipeline would put a stage-to-stage hop and a bubble into every decoded token. The weight stream
broadcasts each stage's converted layers over its pipeline group (`actor.weight_stream`), so the engine of a rank of
stage 0 receives the layers that stage 1 trains, in the PP 1 order and bytes.

Memory: the engine sleeps at level 2 while the actor trains (`sleep`: weights and KV cache discarded) and
`sync` wakes the weights, writes the trainer's bytes on the device, then wakes the KV cache. Mapping and unmapping
that memory costs time in proportion to its size, every step, so the KV cache is what the step can use and no more:
an engine never holds more than its share of the step's sequences (`max_num_seqs`), each at most `max_model_len`
tokens long (`kv_cache_need`), and at most a fraction of the memory free when it starts (`kv_cache_bytes`). The
trainer's cached allocator blocks are handed back before a wake (`torch.cuda.empty_cache`, which makes the
trainer's next phase allocate again) only when the free memory is short of what the engine's last sleep released
(vLLM 0.26's sleep itself empties torch's cache once, after it unmaps).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_jetrl.rollout.engine import RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.pool import shard_bounds
from megatron_jetrl.rollout.sync import Phases, SyncStats


def rollout_groups(world: int, rollout_tp: int) -> int:
    if rollout_tp < 1 or world % rollout_tp:
        raise ValueError(f"rollout.tp={rollout_tp} must divide the number of ranks ({world})")
    return world // rollout_tp


def my_share(count: int, rank: int, world: int, rollout_tp: int) -> tuple[int, int]:
    """The `[start, end)` prompts that this rank's rollout group generates."""
    return shard_bounds(count, rollout_groups(world, rollout_tp))[rank // rollout_tp]


KV_ALIGN = 256
"""Tokens a sequence's KV cache is rounded up to (a multiple of every vLLM block size: 16 by default on Hopper)."""


def kv_bytes_per_token(arch, tp: int = 1, element_bytes: int = 2) -> int:
    """K and V of one token, all layers, on one TP rank (KV heads are split over TP ranks, or replicated when there are
    fewer heads than ranks); `element_bytes` 2 for a BF16 cache, 1 for FP8 (`PrecisionFlow.kv_cache`)."""
    return arch.num_layers * 2 * max(1, arch.num_kv_heads // tp) * arch.head_dim * element_bytes


def kv_cache_need(arch, seqs: int, max_len: int, tp: int = 1, element_bytes: int = 2) -> int:
    """The most KV cache an engine can use: `seqs` sequences (its `max_num_seqs`) of `max_len` tokens, each rounded
    up to `KV_ALIGN` tokens, plus one such slab for vLLM's reserved blocks."""
    tokens = (seqs + 1) * -(-max_len // KV_ALIGN) * KV_ALIGN
    return tokens * kv_bytes_per_token(arch, tp, element_bytes)


def kv_cache_bytes(free_bytes: int, weight_bytes: int, fraction: float, need: int | None = None) -> int:
    """KV cache size: what the engine can use (`need`, from `kv_cache_need`), at most `fraction` of the memory left
    free once the engine's weights are in."""
    left = free_bytes - weight_bytes
    if left <= 0 or fraction <= 0:
        raise ValueError(
            f"no GPU memory left for vLLM's KV cache: {free_bytes / 2**30:.1f} GiB free, weights take "
            f"{weight_bytes / 2**30:.1f} GiB; use rollout.tp > 1, a smaller model or fewer training buffers"
        )
    return int(left * fraction) if need is None else min(int(left * fraction), need)


def sequences_at_once(kv_bytes: int, arch, seqs: int, max_len: int, tp: int = 1, element_bytes: int = 2) -> int:
    """How many of an engine's `seqs` sequences its KV cache of `kv_bytes` holds at their full `max_len` tokens (at
    most `seqs`). Fewer than `seqs`: vLLM still starts them all while they are short, and once the cache is full it
    preempts the newest (frees its blocks; it resumes later by recomputing its prompt and the tokens it has, a
    prefill, and samples on: its logprobs are those of an uninterrupted decode, since the engine's rows do not depend on
    their batch) -- the step runs in turns of about this many. ValueError, naming the settings, when not even one fits."""
    per_seq = -(-max_len // KV_ALIGN) * KV_ALIGN * kv_bytes_per_token(arch, tp, element_bytes)
    held = kv_bytes // per_seq
    if held < 1:
        raise ValueError(
            f"the rollout engine's KV cache of {kv_bytes / 2**30:.2f} GiB per rank cannot hold one sequence of "
            f"rollout.max_model_len={max_len} tokens ({per_seq / 2**30:.2f} GiB at rollout.tp={tp}): raise "
            "rollout.kv_cache_gb or rollout.kv_cache_fraction, free the actor's state while the engine is awake "
            "(rollout.offload=optimizer), lower rollout.max_new_tokens (or rollout.max_model_len), or raise rollout.tp"
        )
    return min(held, seqs)


def turns_note(kv_bytes: int, seqs: int, at_once: int, max_len: int) -> str | None:
    """None when an engine's KV cache holds all its `seqs` at their full length; else the start-up line that says how
    many it holds and what happens to the rest."""
    if at_once >= seqs:
        return None
    return (
        f"the rollout engine's KV cache ({kv_bytes / 2**30:.2f} GiB per rank) holds {at_once} of the {seqs} sequences it "
        f"samples a step at their full {max_len} tokens: the step runs in turns, vLLM preempting the newest sequences "
        "once the cache is full and recomputing them later (counted per step: rollout/preemptions); for one turn, raise "
        "rollout.kv_cache_gb or rollout.kv_cache_fraction, or free the actor's state while the engine is awake: "
        "rollout.offload=optimizer"
    )


class ColocatedPool:
    """The `TrainerPool` of one engine per rank; every method is collective over the world."""

    weight_target = "all"

    def __init__(self, engine, *, rollout_tp: int = 1, group=None, at_once: int | None = None):
        self.engine = engine
        self.rollout_tp = rollout_tp
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        rollout_groups(self.world, rollout_tp)
        self.last_sync: SyncStats | None = None
        self.sleep_seconds: float | None = None
        self.wake_bytes: int | None = None
        self.at_once = at_once  # the sequences this rank's engine holds at their full length (`sequences_at_once`)
        self.preemptions: int | None = None  # requests the engine preempted in the last generate (None: not counted)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        prompts = list(prompts)
        seeds = request_seeds_for(sampling, len(prompts)) if request_seeds is None else list(request_seeds)
        start, end = my_share(len(prompts), self.rank, self.world, self.rollout_tp)
        mine, error = [], None
        counted = getattr(self.engine, "preemptions", lambda: None)
        before = counted()
        if end > start:
            try:
                mine = self.engine.generate(
                    prompts[start:end], sampling, request_seeds=None if seeds is None else seeds[start:end]
                )
                if len(mine) != end - start:
                    raise RuntimeError(f"returned {len(mine)} outputs for {end - start} prompts")
            except Exception as e:  # noqa: BLE001 - said on every rank below, not only on this one
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts = [None] * self.world
        dist.all_gather_object(parts, (error, mine if self.rank % self.rollout_tp == 0 else None), group=self.group)
        after = counted()
        self.preemptions = None if before is None or after is None else after - before
        errors = [e for e, _ in parts if e is not None]
        if errors:  # every rank stops now, naming the engine that failed (not after run.timeout_s in the next collective)
            raise RuntimeError("the rollout engine failed during generate on " + "; ".join(errors))
        out = [o for _, part in parts if part is not None for o in part]
        if len(out) != len(prompts):
            raise RuntimeError(f"the rollout groups returned {len(out)} outputs for {len(prompts)} prompts")
        return out

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Wake the weights, write the trainer's stream into them, wake the KV cache; time, bytes and the seconds of
        each part (`SyncStats.parts`)."""
        start = time.perf_counter()
        parts = Phases("sync/", "_s")
        with parts("empty_cache"):
            if self.short_of_memory():
                torch.cuda.empty_cache()  # the trainer's cached blocks go back so that vLLM can map its memory again
        with parts("wake_weights"):
            self.engine.wake(["weights"])
        done = self.engine.update_weights(weights, phases=parts)
        with parts("wake_kv"):
            if self.wake_bytes is not None and self.short_of_memory():  # the stream's buffers took the spare: again
                torch.cuda.empty_cache()
            self.engine.wake(["kv_cache"])
        self.last_sync = SyncStats(
            tensors=done["tensors"], bytes=done["bytes"], buckets=1, seconds=time.perf_counter() - start, parts=dict(parts)
        )
        return self.last_sync

    def short_of_memory(self) -> bool:
        """Whether the device's free memory is short of what the engine's last sleep released (1 GiB spare), so
        that the wake needs the trainer's cached blocks; before the first sleep, whether CUDA is in use at all."""
        if not torch.cuda.is_initialized():
            return False
        if self.wake_bytes is None:
            return True
        return torch.cuda.mem_get_info()[0] < self.wake_bytes + (1 << 30)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sync(weights)

    def sleep(self) -> None:
        """The engine's sleep; its seconds (`sleep_seconds`) and the device memory it releases (`wake_bytes`, what
        the next wake maps again, as the engine's allocator counts it)."""
        self.wake_bytes = self.engine.mapped_bytes()
        start = time.perf_counter()
        self.engine.sleep()
        self.sleep_seconds = time.perf_counter() - start

    def wake(self) -> None:
        self.engine.wake()

    def unmapped_bytes(self) -> int:
        return self.engine.unmapped_bytes()

    def metrics(self) -> dict[str, float]:
        """The engine's sleep after the last rollout: seconds, and the GiB it released; the sequences the engine holds
        at their full length (`rollout/fit_at_once`) and the ones vLLM preempted in the last rollout, the most on any
        rank (`rollout/preemptions`: each is recomputed from its tokens so far). Collective when preemptions are counted."""
        if self.sleep_seconds is None:
            return {}
        out = {"rollout/sleep_s": self.sleep_seconds, "rollout/sleep_released_gib": (self.wake_bytes or 0) / 2**30}
        if self.at_once:
            out["rollout/fit_at_once"] = self.at_once
        if self.preemptions is not None:
            most = torch.tensor(
                [self.preemptions],
                dtype=torch.float64,
                device=torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend(self.group) == "nccl"
                else torch.device("cpu"),
            )
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            out["rollout/preemptions"] = int(most.item())
        return out
