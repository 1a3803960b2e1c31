"""Sequence parallelism's communication for the FP8 linear: 1x128-quantized rows gathered as bytes, and the forward's
gather or reduce-scatter overlapped with its GEMM (`SPOverlap`).

Every function here moves rows; none computes. A column-parallel forward gathers each rank's quantized rows (a 1x128
group lies inside one row, so the gathered bytes are those of quantizing the gathered BF16) and multiplies them; a
row-parallel forward multiplies the whole sequence's rows and keeps its own rows of the sum over the group. The GEMM
is the caller's `mm(q, s) -> y`, each output row a function of its input row alone: so however the rows are split
below, a gathered output is the one-collective output to the bit. A reduce-scattered output sums the ranks' partial
outputs in the order its collective has (NCCL's for `none` and `chunks`, the ring's for `ring`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

OVERLAPS = ("none", "chunks", "ring")


@dataclass(frozen=True)
class SPOverlap:
    """How a sequence-parallel FP8 forward overlaps its communication with its GEMM."""

    kind: str = "none"
    """`none`: one collective, then the GEMM (row-parallel: the GEMM, then one reduce-scatter). `chunks`: every rank's
    rows in `chunks` pieces, every piece's collective issued at once; piece c's GEMM runs while later pieces travel.
    `ring` (async TP's decomposition): tp - 1 point-to-point steps around the TP group; a column-parallel linear
    multiplies the shard it holds while passing it on, a row-parallel one multiplies the next destination's rows while
    the running sums travel; a reduce-scattered output then sums rank by rank, from the rank after its owner round to
    the owner."""
    chunks: int = 1
    """Pieces of every rank's rows under `chunks` (2 or more); 1 otherwise."""

    def __post_init__(self):
        if self.kind not in OVERLAPS:
            raise ValueError(f"SPOverlap.kind must be one of {OVERLAPS}, got {self.kind!r}")
        if (self.kind == "chunks") != (self.chunks > 1) or self.chunks < 1:
            raise ValueError(
                f"SPOverlap(kind={self.kind!r}, chunks={self.chunks}): chunks is the piece count of kind 'chunks' "
                "(2 or more) and 1 for the other kinds"
            )


NO_OVERLAP = SPOverlap()

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`mm(q, s) -> y`: a GEMM of quantized rows `q [M, K]` (E4M3) and their 1x128 scales `s [M, K/128]`."""


def gather_rows(x_q, x_s, group, async_op: bool = False):
    """All-gather 1x128-quantized rows along dim 0 over `group` (rank order, as megatron gathers a sequence): the E4M3
    bytes travel as uint8 (gloo has no FP8 type) and the scales as `[rows, K/128]` FP32; the gathered scales come back
    in the quantizer's outer-dim-major layout. A 1x128 group lies inside one row, so these are the bytes and scales of
    quantizing the gathered rows. With `async_op`, also the two pending works (wait on them before reading)."""
    world = dist.get_world_size(group)
    q_all = torch.empty((world * x_q.shape[0], x_q.shape[1]), dtype=torch.uint8, device=x_q.device)
    s_all = torch.empty((world * x_s.shape[0], x_s.shape[1]), dtype=x_s.dtype, device=x_s.device)
    works = (
        dist.all_gather_into_tensor(q_all, x_q.contiguous().view(torch.uint8), group=group, async_op=async_op),
        dist.all_gather_into_tensor(s_all, x_s.contiguous(), group=group, async_op=async_op),
    )
    if async_op:
        return q_all.view(x_q.dtype), s_all, works
    return q_all.view(x_q.dtype), scales_like(s_all, x_s)


def scales_like(s_all: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Row-major `[M, K/128]` scales (or rows sliced from a larger tensor) in the layout the quantizer gave `local`:
    row-major, or outer-dim-major (strides (1, M), the CUDA kernels')."""
    return s_all if local.is_contiguous() else s_all.t().contiguous().t()


def gathered_shape(shape: torch.Size, world: int) -> torch.Size:
    """A sequence shard's shape `[s, ..., K]` with the sequence gathered over `world` ranks."""
    return torch.Size((shape[0] * world, *shape[1:]))


def scatter_rows(y: torch.Tensor, group) -> torch.Tensor:
    """A row-parallel output `[T, N]` summed over `group`, this rank's `T / world` rows kept (reduce-scatter)."""
    out = torch.empty((y.shape[0] // dist.get_world_size(group), y.shape[1]), dtype=y.dtype, device=y.device)
    dist.reduce_scatter_tensor(out, y.contiguous(), group=group)
    return out


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """`rows` split into `chunks` (at most `rows`) consecutive ranges, the same on every rank."""
    chunks = max(1, min(chunks, rows))
    edges = [rows * c // chunks for c in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def gathered_matmul(x_q, x_s, mm: Matmul, group, overlap: SPOverlap, out_cols: int, out_dtype) -> torch.Tensor:
    """`mm` of the sequence gathered over `group` (rank r's rows at `[r T, (r + 1) T)`) from this rank's quantized rows
    `x_q [T, K]`, `x_s`; `[world T, out_cols]` in `out_dtype`."""
    if overlap.kind == "none":
        return mm(*gather_rows(x_q, x_s, group))
    if overlap.kind == "ring":
        return _gathered_ring(x_q, x_s, mm, group, out_cols, out_dtype)
    world, t = dist.get_world_size(group), x_q.shape[0]
    pieces = chunk_bounds(t, overlap.chunks)
    pending = [gather_rows(x_q[a:b], x_s[a:b], group, async_op=True) for a, b in pieces]
    y = torch.empty((world, t, out_cols), dtype=out_dtype, device=x_q.device)
    for (a, b), (q, s, works) in zip(pieces, pending, strict=True):
        for work in works:
            work.wait()
        y[:, a:b] = mm(q, scales_like(s, x_s)).view(world, b - a, -1)
    return y.view(world * t, -1)


def matmul_scattered(x_q, x_s, mm: Matmul, group, overlap: SPOverlap, out_cols: int, out_dtype) -> torch.Tensor:
    """`mm` of the whole sequence's rows `x_q [world T, K]` (this rank's slice of K), summed over `group`: this rank's
    `[T, out_cols]` rows of the sum."""
    if overlap.kind == "none":
        return scatter_rows(mm(x_q, x_s), group)
    if overlap.kind == "ring":
        return _scattered_ring(x_q, x_s, mm, group, out_dtype)
    world = dist.get_world_size(group)
    t = x_q.shape[0] // world
    y = torch.empty((t, out_cols), dtype=out_dtype, device=x_q.device)
    q = x_q.view(torch.uint8).view(world, t, -1)  # (uint8: indexing has no FP8 kernels everywhere)
    scales = x_s.view(world, t, -1)
    works = []
    for a, b in chunk_bounds(t, overlap.chunks):  # every rank's rows [a, b) of its shard, rank by rank
        part_q = q[:, a:b].reshape(-1, q.shape[-1]).view(x_q.dtype)
        part = mm(part_q, scales_like(scales[:, a:b].reshape(-1, scales.shape[-1]), x_s))
        works.append(dist.reduce_scatter_tensor(y[a:b], part, group=group, async_op=True))
    for work in works:
        work.wait()
    return y


def _ring(group) -> tuple[int, int, int, int]:
    """This rank's index in `group`, the group's size, and the global ranks after and before it (wrapping round)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, world, dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)


def _ring_step(sends: list[torch.Tensor], recvs: list[torch.Tensor], after: int, before: int, group):
    """Send `sends` to global rank `after` and receive `recvs` from `before`, all at once; the pending works."""
    ops = [dist.P2POp(dist.isend, t, after, group) for t in sends] + [dist.P2POp(dist.irecv, t, before, group) for t in recvs]
    return dist.batch_isend_irecv(ops)


def _wire(s: torch.Tensor) -> torch.Tensor:
    """The contiguous view of 1x128 scales as laid out (`_sendable`): themselves, or the transpose of outer-dim-major
    ones."""
    return s if s.is_contiguous() else s.t()


def _sendable(s: torch.Tensor) -> torch.Tensor:
    """Scales that `_wire` views contiguously: row-major or outer-dim-major as they are, others made row-major."""
    return s if s.is_contiguous() or s.t().is_contiguous() else s.contiguous()


def _gathered_ring(x_q, x_s, mm: Matmul, group, out_cols: int, out_dtype) -> torch.Tensor:
    """The gather as a ring: at step i this rank multiplies the shard of rank r - i while passing it to rank r + 1 and
    receiving rank r - i - 1's from rank r - 1."""
    (rank, world, after, before), t = _ring(group), x_q.shape[0]
    y = torch.empty((world * t, out_cols), dtype=out_dtype, device=x_q.device)
    q, s = x_q.contiguous().view(torch.uint8), _sendable(x_s)  # (K not a multiple of 16: the bytes sit in wider rows)
    for i in range(world):
        works = []
        if i < world - 1:
            q_in, s_in = torch.empty_like(q), torch.empty_like(s)  # (empty_like keeps the scales' strides)
            works = _ring_step([q, _wire(s)], [q_in, _wire(s_in)], after, before, group)
        src = (rank - i) % world
        y[src * t : (src + 1) * t] = mm(q.view(x_q.dtype), s)
        for work in works:
            work.wait()
        if works:
            q, s = q_in, s_in
    return y


def _scattered_ring(x_q, x_s, mm: Matmul, group, out_dtype) -> torch.Tensor:
    """The reduce-scatter as a ring: at step i this rank multiplies the rows of rank r - i - 1 while the running sum of
    its previous step's rows travels to rank r + 1; it adds the sum it receives to that product and passes it on, and
    at the last step keeps its own rows' sum."""
    rank, world, after, before = _ring(group)
    t = x_q.shape[0] // world
    q = x_q.view(torch.uint8)
    works, incoming = [], None
    for i in range(world):
        dst = (rank - i - 1) % world
        rows = slice(dst * t, (dst + 1) * t)
        part = mm(q[rows].view(x_q.dtype), scales_like(x_s[rows], x_s))
        for work in works:
            work.wait()
        if incoming is not None:
            part += incoming
        if i < world - 1:
            incoming = torch.empty_like(part)
            works = _ring_step([part], [incoming], after, before, group)
    return part
