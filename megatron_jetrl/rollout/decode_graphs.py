"""CUDA graphs of the native engine's decode step.

A decode step of a B-row batch is a few hundred small kernels (per linear: the 1x128 quantizer, the
scale layouts and the GEMM in FP8; one GEMM in BF16). Launched one by one from Python they cost more
than the weight reads they do, which hides the FP8 weights' halved bytes. A graph replays the whole step
with one launch. Shapes are static inside a graph, so every cache row decodes in every step (a finished
row decodes a dummy token into its own slot 0), and attention reads a span of the cache rounded up to
`SPAN_STEP` slots: one graph per span, captured the first time a generation reaches it. The graphs live
as long as one `generate()` call (they point at its KV cache) and share one memory pool; they replay in
the order they were captured.
"""

from __future__ import annotations

import torch

SPAN_STEP = 256
"""Attention span granularity in cache slots: more graphs if smaller, more masked keys read if larger."""


class DecodeGraphs:
    """One decode step over every row of `cache`, as a CUDA graph per attention span."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        rows = cache.k[0].shape[0]
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=engine.device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=engine.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        engine._rope_tables(cache.capacity)  # grown now: growing it inside a capture would wait for the device

    def step(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """FP32 logits `[B, V]` of one token per cache row at its position; valid until the next step."""
        span = min(self.cache.capacity, -(-(max(positions) + 1) // SPAN_STEP) * SPAN_STEP)
        self.tokens.copy_(torch.tensor(tokens)[:, None])
        self.positions.copy_(torch.tensor(positions)[:, None])
        if span not in self.graphs:
            self.graphs[span] = self._capture(span)
        graph, logits = self.graphs[span]
        graph.replay()
        return logits

    def _forward(self, span: int) -> torch.Tensor:
        e = self.engine
        hidden = e.hidden_states(self.tokens, self.positions, self.positions[:, 0] + 1, self.cache, span=span)
        return e.logits(hidden[:, 0])

    def _capture(self, span: int):
        side = torch.cuda.Stream(self.engine.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: Triton compiles, cuBLASLt's self-test, weight caches
            self._forward(span)  # (it writes the same K/V to the same slots as the replay will)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(span)
        return graph, logits
