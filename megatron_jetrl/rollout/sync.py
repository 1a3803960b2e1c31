"""Live weight sync: stream the trainer's HF `(name, tensor)` pairs to rollout engines in buckets.

FP8 bytes travel as a `uint8` view (gloo and some NCCL paths refuse float8 dtypes) and are viewed back
on arrival -- a view, never a conversion, so the engine receives the trainer's exact bytes. A bucket
packs many tensors into one flat `uint8` buffer plus a small metadata list (what a broadcast carries);
an FP8 weight and its `weight_scale_inv` always land in the same bucket, since an engine refuses one
without the other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SCALE_SUFFIX = ".weight_scale_inv"
_WIRE_VIEW = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def to_wire(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """A tensor a collective accepts (FP8 -> its uint8 byte view) and the dtype to restore."""
    view = _WIRE_VIEW.get(tensor.dtype)
    return (tensor.view(view) if view is not None else tensor), tensor.dtype


def from_wire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo `to_wire`: the same bytes, viewed as `dtype`."""
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def _group_key(name: str) -> str:
    """FP8 weight and scale of one linear share a key (they must travel together)."""
    if name.endswith(SCALE_SUFFIX):
        return name.removesuffix(SCALE_SUFFIX)
    return name.removesuffix(".weight") if name.endswith(".weight") else name


def buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group the stream into lists of about `bucket_bytes` (a larger tensor gets a bucket of its own).

    A bucket closes only between groups: `<x>.weight` and `<x>.weight_scale_inv` stay together.
    Works on the stream lazily: at most one bucket is held at a time.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size, open_key = 0, None
    for name, tensor in pairs:
        key = _group_key(name)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and key != open_key and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        open_key = key
    if bucket:
        yield bucket


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def pack(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[TensorMeta]]:
    """One flat uint8 buffer (on the first tensor's device) and the metadata to cut it back."""
    metas, parts, offset = [], [], 0
    for name, tensor in bucket:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat, metas


def unpack(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a packed bucket: views of `flat`, bytes unchanged."""
    return [(m.name, flat[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in metas]


def broadcast_bucket(
    flat: torch.Tensor | None, metas: list[TensorMeta] | None, *, src: int, group=None, device="cpu"
) -> list[tuple[str, torch.Tensor]]:
    """Broadcast one packed bucket from rank `src` over a torch.distributed group (gloo or NCCL).

    `src` passes `flat`/`metas`; the others pass None and receive. Metadata goes as a Python object,
    the bytes as one uint8 tensor.
    """
    import torch.distributed as dist

    box = [metas]
    dist.broadcast_object_list(box, src=src, group=group)
    metas = box[0]
    total = sum(m.nbytes for m in metas)
    if flat is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=src, group=group)
    return unpack(flat, metas)


ALLOCATOR_STALLS = {"alloc_retries": "num_alloc_retries", "cuda_frees": "num_device_free"}
"""torch's caching-allocator counters (`torch.cuda.memory_stats`) of events that synchronize the device: an allocation
that found no cached block and no free memory, freed the cache and retried; a block given back to the driver."""


def allocator_stalls() -> tuple[int, ...]:
    """The current values of `ALLOCATOR_STALLS`' counters on this process's device (0 where torch lacks one)."""
    stats = torch.cuda.memory_stats()
    return tuple(int(stats.get(key, 0)) for key in ALLOCATOR_STALLS.values())


class Phases(dict):
    """Wall time per named phase (seconds, summed over repeats), the GPU's share included: a phase ends with a device
    sync once CUDA is in use. The host issues kernels ahead of the GPU, so without it a phase's queued GPU work was
    billed to the next phase's first sync (in GRPO, the eval forward's to the update, whose reward check syncs first).
    Keys are `prefix + name + suffix`: `time/rollout` for the train loop's phases, `sync/wake_kv_s` for a sync's parts.
    `around(name)`, a context manager, encloses each phase inside its timing (the train loop's: the run context's
    `phase`, which its subscribers, the profiler among them, watch). `memory=True` (the train loop's phases,
    not nested ones: it resets torch's peak counters at each phase's start) also keeps, once CUDA is in use, the most
    bytes torch's caching allocator had allocated and reserved during each phase (`peaks[name]`), less what a
    sleeping colocated engine holds unmapped through the whole phase (`unmapped()`, sampled as the phase starts and
    ends): vLLM's sleep unmaps its weights and KV cache but leaves their blocks in torch's counters, which would
    otherwise count them while the actor trains (above the card's size at Qwen3-8B's PP 4). With `memory`, `stalls[name]`
    counts the allocator's device-wide stalls in each phase (summed over repeats): retries of an allocation after
    freeing its cached blocks, and its cudaFree calls; each synchronizes the device, so the host stops running ahead of
    the GPU (`ALLOCATOR_STALLS`)."""

    def __init__(
        self,
        prefix: str = "time/",
        suffix: str = "",
        around: Callable[[str], Any] | None = None,
        memory: bool = False,
        unmapped: Callable[[], int] | None = None,
    ):
        super().__init__()
        self.prefix, self.suffix, self.around, self.memory, self.unmapped = prefix, suffix, around, memory, unmapped
        self.peaks: dict[str, tuple[int, int]] = {}
        self.stalls: dict[str, tuple[int, ...]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        counting = self.memory and torch.cuda.is_initialized()
        if counting:
            torch.cuda.reset_peak_memory_stats()
            asleep = self.unmapped() if self.unmapped is not None else 0
            stalls = allocator_stalls()
        with self.around(name) if self.around is not None else contextlib.nullcontext():
            yield
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            if counting:
                asleep = min(asleep, self.unmapped() if self.unmapped is not None else 0)
                before = self.peaks.get(name, (0, 0))
                self.peaks[name] = (
                    max(before[0], torch.cuda.max_memory_allocated() - asleep),
                    max(before[1], torch.cuda.max_memory_reserved() - asleep),
                )
                so_far = self.stalls.get(name, (0,) * len(ALLOCATOR_STALLS))
                self.stalls[name] = tuple(a + now - then for a, now, then in zip(so_far, allocator_stalls(), stalls))
        key = f"{self.prefix}{name}{self.suffix}"
        self[key] = self.get(key, 0.0) + time.perf_counter() - start


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    per_engine_seconds: list[float] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per part of a colocated sync (`sync/<part>_s`: empty_cache, wake_weights, stream, validate, copy,
    wake_kv), each ending with a device sync."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {
            f"{prefix}tensors": self.tensors,
            f"{prefix}bytes": self.bytes,
            f"{prefix}buckets": self.buckets,
            f"{prefix}seconds": self.seconds,
            f"{prefix}GBps": self.gbps,
            **self.parts,
        }


def stream_weights(
    pairs: Iterable[tuple[str, torch.Tensor]], engines: Sequence, *, bucket_bytes: int = 256 << 20, wire: bool = True
) -> SyncStats:
    """Push the trainer's stream to every engine, one bucket at a time; report time and bytes.

    With `wire=True` each bucket is packed into a uint8 buffer and unpacked (what crosses a process
    boundary), so FP8 bytes take the same path as in a distributed sync. Each engine's
    `update_weights(bucket)` validates the bucket before applying it.
    """
    stats = SyncStats(per_engine_seconds=[0.0] * len(engines))
    start = time.perf_counter()
    for bucket in buckets(pairs, bucket_bytes):
        if wire:
            flat, metas = pack(bucket)
            bucket = unpack(flat, metas)
        stats.buckets += 1
        stats.tensors += len(bucket)
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        for i, engine in enumerate(engines):
            t0 = time.perf_counter()
            engine.update_weights(bucket)
            stats.per_engine_seconds[i] += time.perf_counter() - t0
    stats.seconds = time.perf_counter() - start
    return stats
