"""What the benchmarks share: the Qwen3-8B shapes they time (and a tiny stand-in for CPU smoke runs), and a timer that
ends with a device sync, and one that takes a median. Imported as `tools.bench.common` (each benchmark puts the repository on sys.path first)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
"""Qwen3-8B's HF config, less its layer count (each benchmark sets `num_hidden_layers`)."""
TINY = dict(QWEN3_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
"""The same family at toy size: the benchmarks' `--tiny` CPU smoke runs."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    """(seconds, result) of `fn()`, the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def median_ms(step, device: torch.device, reps: int) -> float:
    """Median ms of `step()` over `reps` calls, after 3 warm-up calls: CUDA events around each call on the GPU (the
    current stream's work), the host's clock on the CPU."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def agreed_exit(ok: bool, device: torch.device, failure: str) -> int:
    """A multi-rank benchmark's end: every rank's check agreed over the default group (0 only if all passed), the group
    destroyed, `failure` printed by each rank whose check failed; the exit code."""
    import torch.distributed as dist

    flags = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: {failure}", file=sys.stderr)
    return 0 if flags.item() else 1


def graphed(fn):
    """`fn`'s launches captured once in a CUDA graph (after a warm-up call on the capture's stream); its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
