"""A data-parallel pool of rollout engines that is itself a `RolloutEngine`.

Prompts are cut into contiguous, balanced shards (engine k gets prompts `[start_k, end_k)`), served
concurrently, and the outputs come back in prompt order. Request seeds are global (`seed + prompt
index`), so with seeded sampling a prompt gets the same completions whichever engine serves it and
however many engines there are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

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

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                 request_seeds: Sequence[int] | None = None) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        prompts = list(prompts)
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        elif len(request_seeds) != len(prompts):
            raise ValueError(f"{len(request_seeds)} request_seeds for {len(prompts)} prompts")
        jobs = [(engine, start, end) for engine, (start, end) in zip(self.engines, shard_bounds(len(prompts), len(self.engines)))
                if end > start]

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
