"""A tensor-parallel sum in one fixed order, the same bytes in the trainer and in vLLM.

A row-parallel linear's output is the sum of the TP ranks' partial outputs. NCCL's ring and tree all-reduces and
vLLM's custom all-reduce kernels add them in orders of their own (by the rank's place in the ring, the chunk, the
kernel), so at TP > 2 the trainer and the engine round the same partial sums differently. Here every element of the
sum is the partials added in rank order in FP32 and rounded once to the input's dtype (`ordered_sum`): every rank,
and every program that sums the same partials this way, gets the same bytes, whichever collective brought the
partials together. Up to TP 2 the sum is one addition of two numbers, already the same in any order. The actor's
row-parallel linears take it under `precision.exact_logprobs` above TP 2 (`actor.fp8_layers`), and vLLM's TP
all-reduce is replaced by it there (patches/vllm_0_26_0_ordered_all_reduce.py).

The two sides move the partials differently, for the sizes each sums:
* the actor (`ordered_all_reduce`, thousands of tokens a micro-batch: bandwidth-bound) reduce-scatters in rank order
  and all-gathers the sums: an all-to-all gives each rank every rank's piece of its 1/world share, it sums them, and
  an all-gather returns the shares. That is 2 (world - 1) / world of the tensor received per rank, a ring
  all-reduce's bytes, and 1/world of the additions;
* vLLM (a decode step's few rows: latency-bound) all-gathers the partials in one collective and sums them all
  (`(world - 1)` times the tensor received).
On CUDA `ordered_sum` is one Triton kernel (each element loaded once per rank, added in rank order in FP32, stored
once, rounded to nearest even as torch's cast rounds); elsewhere torch's ops compute the same formula.
"""

from __future__ import annotations

import functools

import torch

from megatron_jetrl.fp8.kernels import triton_available

BLOCK = 1024
"""Elements per program of the CUDA sum."""


def ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """`parts[world, ...]` summed over dim 0 in index order, in FP32, rounded once to `parts.dtype`."""
    if parts.is_cuda and triton_available():
        out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
        if out.numel():
            _launch_sum(parts.contiguous(), out)
        return out
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts.dtype)


def ordered_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over `group`'s ranks, in rank order (`ordered_sum`), on every rank; a new tensor. Reduce-scattered
    in rank order (an all-to-all of each rank's share of the elements, summed where it lands), then all-gathered."""
    world = torch.distributed.get_world_size(group)
    flat = x.contiguous().view(-1)
    share = -(-flat.numel() // world)
    if share * world != flat.numel():  # the last share runs past the end: zeros there, whose sums are never read
        flat = torch.cat((flat, flat.new_zeros(share * world - flat.numel())))
    pieces = torch.empty_like(flat)  # [world, share]: every rank's piece of this rank's share, in rank order
    torch.distributed.all_to_all_single(pieces, flat, group=group)
    summed = torch.empty_like(flat)
    torch.distributed.all_gather_into_tensor(summed, ordered_sum(pieces.view(world, share)), group=group)
    return summed[: x.numel()].view(x.shape)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from megatron_jetrl.fp8.launch import Launcher

    @triton.jit
    def _ordered_sum(parts_ptr, out_ptr, n, WORLD: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        part = parts_ptr + offs
        total = tl.load(part, mask=inside).to(tl.float32)
        for _ in tl.static_range(1, WORLD):
            part += n  # the next rank's partials (pointer arithmetic: no 32-bit product to overflow)
            total = total + tl.load(part, mask=inside).to(tl.float32)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=inside)  # fp32 -> bf16/fp16: nearest even

    return Launcher(_ordered_sum)


def _launch_sum(parts: torch.Tensor, out: torch.Tensor) -> None:
    n = out.numel()
    _kernel()[(-(-n // BLOCK),)](parts, out, n, WORLD=parts.shape[0], BLOCK=BLOCK, num_warps=4)


class OrderedAllReduce(torch.autograd.Function):
    """`ordered_all_reduce` forward; the gradient passes through unchanged, as megatron's
    `reduce_from_tensor_model_parallel_region` passes it (every rank's partial output feeds the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        return ordered_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
