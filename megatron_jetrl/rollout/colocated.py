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

Memory: the engine sleeps at level 2 while the actor trains (`sleep`: weights and KV cache discarded) and
`sync` wakes the weights, writes the trainer's bytes on the device, then wakes the KV cache. The KV cache is
sized from the memory free when the engine starts (`kv_cache_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_jetrl.rollout.engine import RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.pool import shard_bounds
from megatron_jetrl.rollout.sync import SyncStats


def rollout_groups(world: int, rollout_tp: int) -> int:
    if rollout_tp < 1 or world % rollout_tp:
        raise ValueError(f"rollout.tp={rollout_tp} must divide the number of ranks ({world})")
    return world // rollout_tp


def my_share(count: int, rank: int, world: int, rollout_tp: int) -> tuple[int, int]:
    """The `[start, end)` prompts that this rank's rollout group generates."""
    return shard_bounds(count, rollout_groups(world, rollout_tp))[rank // rollout_tp]


def kv_cache_bytes(free_bytes: int, weight_bytes: int, fraction: float) -> int:
    """KV cache size: `fraction` of the memory left free once the engine's weights are in."""
    left = free_bytes - weight_bytes
    if left <= 0 or fraction <= 0:
        raise ValueError(f"no GPU memory left for vLLM's KV cache: {free_bytes / 2**30:.1f} GiB free, weights take "
                         f"{weight_bytes / 2**30:.1f} GiB; use rollout.tp > 1, a smaller model or fewer training buffers")
    return int(left * fraction)


class ColocatedPool:
    """`RolloutEngine`-shaped pool over this rank's engine; every method is collective over the world."""

    colocated = True

    def __init__(self, engine, *, rollout_tp: int = 1, group=None):
        self.engine = engine
        self.rollout_tp = rollout_tp
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        rollout_groups(self.world, rollout_tp)
        self.last_sync: SyncStats | None = None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                 request_seeds: Sequence[int] | None = None) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        prompts = list(prompts)
        seeds = request_seeds_for(sampling, len(prompts)) if request_seeds is None else list(request_seeds)
        start, end = my_share(len(prompts), self.rank, self.world, self.rollout_tp)
        mine, error = [], None
        if end > start:
            try:
                mine = self.engine.generate(prompts[start:end], sampling,
                                            request_seeds=None if seeds is None else seeds[start:end])
                if len(mine) != end - start:
                    raise RuntimeError(f"returned {len(mine)} outputs for {end - start} prompts")
            except Exception as e:  # noqa: BLE001 - said on every rank below, not only on this one
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts = [None] * self.world
        dist.all_gather_object(parts, (error, mine if self.rank % self.rollout_tp == 0 else None), group=self.group)
        errors = [e for e, _ in parts if e is not None]
        if errors:  # every rank stops now, naming the engine that failed (not after run.timeout_s in the next collective)
            raise RuntimeError("the rollout engine failed during generate on " + "; ".join(errors))
        out = [o for _, part in parts if part is not None for o in part]
        if len(out) != len(prompts):
            raise RuntimeError(f"the rollout groups returned {len(out)} outputs for {len(prompts)} prompts")
        return out

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Wake the weights, write the trainer's stream into them, wake the KV cache; time and bytes."""
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the trainer's cached blocks go back before vLLM maps its memory again
        self.engine.wake(["weights"])
        done = self.engine.update_weights(weights)
        self.engine.wake(["kv_cache"])
        self.last_sync = SyncStats(tensors=done["tensors"], bytes=done["bytes"], buckets=1,
                                   seconds=time.perf_counter() - start)
        return self.last_sync

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sync(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()
