"""A data-parallel pool of rollout engines that is itself a `RolloutEngine`, and `RankZeroPool`: such a pool on
global rank 0, served to every rank of a run (the `TrainerPool` of the native engines).

Prompts are cut into contiguous, balanced shards (engine k gets prompts `[start_k, end_k)`), served
concurrently, and the outputs come back in prompt order. Request seeds are global (`seed + prompt
index`), so with seeded sampling a prompt gets the same completions whichever engine serves it and
however many engines there are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron_jetrl.rollout.engine import RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.sync import SyncStats, stream_weights


def shard_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Balanced contiguous `[start, end)` ranges: the first `count % parts` shards get one more."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class RolloutPool:
    """N engines, data parallel. `generate` shards prompts; `update_weights` streams to all of them."""

    def __init__(self, engines: Sequence, *, bucket_bytes: int = 256 << 20, concurrent: bool = True):
        if not engines:
            raise ValueError("a RolloutPool needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self.concurrent = concurrent and len(self.engines) > 1
        self.last_sync: SyncStats | None = None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        prompts = list(prompts)
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        elif len(request_seeds) != len(prompts):
            raise ValueError(f"{len(request_seeds)} request_seeds for {len(prompts)} prompts")
        jobs = [
            (engine, start, end)
            for engine, (start, end) in zip(self.engines, shard_bounds(len(prompts), len(self.engines)))
            if end > start
        ]

        def run(job):
            engine, start, end = job
            seeds = None if request_seeds is None else list(request_seeds[start:end])
            out = engine.generate(prompts[start:end], sampling, request_seeds=seeds)
            if len(out) != end - start:
                raise RuntimeError(f"engine {engine!r} returned {len(out)} outputs for {end - start} prompts")
            return out

        if self.concurrent:
            with ThreadPoolExecutor(max_workers=len(jobs)) as executor:
                parts = list(executor.map(run, jobs))
        else:
            parts = [run(job) for job in jobs]
        return [output for part in parts for output in part]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.last_sync = stream_weights(weights, self.engines, bucket_bytes=self.bucket_bytes)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """`update_weights` that returns the time/bytes report."""
        self.update_weights(weights)
        return self.last_sync

    def sleep(self) -> None:
        for engine in self.engines:
            engine.sleep()

    def wake(self) -> None:
        for engine in self.engines:
            engine.wake()


class RankZeroPool:
    """A `TrainerPool` over a `RolloutPool` that lives on global rank 0 (`pool`: None on the other ranks).

    `generate` runs there and hands every rank its outputs (one object broadcast; an engine's error is raised on
    every rank, naming it); `sync` feeds rank 0's engines and lets the other ranks' share of the stream pass. The
    native engines keep their weights between steps: `sleep` frees nothing."""

    weight_target = "rank0"

    def __init__(self, pool: RolloutPool | None):
        self.pool = pool

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        box = [None]
        if self.pool is not None:
            try:
                box = [(None, self.pool.generate(prompts, sampling, request_seeds=request_seeds))]
            except Exception as e:  # noqa: BLE001 - raised on every rank below, not only on this one
                box = [(f"rank 0: {type(e).__name__}: {e}", None)]
                failure = e
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        error, outputs = box[0]
        if error is not None:
            if self.pool is not None:
                raise failure
            raise RuntimeError(f"the rollout engine failed during generate on {error}")
        return outputs

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        if self.pool is None:
            for _ in weights:  # this rank's share of the collective gathers
                pass
            return SyncStats()
        return self.pool.sync(weights)

    def sleep(self) -> None:
        pass

    def unmapped_bytes(self) -> int:
        return 0

    def metrics(self) -> dict[str, float]:
        return {}
