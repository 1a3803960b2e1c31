"""A tensor-parallel sum in one fixed order, the same bytes in the trainer and in vLLM.

A row-parallel linear's output is the sum of the TP ranks' partial outputs. NCCL's ring and tree all-reduces and
vLLM's custom all-reduce kernels add them in orders of their own (by the rank's place in the ring, the chunk, the
kernel), so at TP > 2 the trainer and the engine round the same partial sums differently. `ordered_all_reduce`
all-gathers the partials and adds them in rank order in FP32, rounding once to the input's dtype: every rank, and
every program that calls it on the same partials, gets the same bytes. Up to TP 2 the sum is one addition of two
numbers, already the same in any order. The actor's row-parallel linears run it under `precision.exact_logprobs`
above TP 2 (`actor.fp8_layers`), and vLLM's TP all-reduce is replaced by it there
(patches/vllm_0_26_0_ordered_all_reduce.py). It costs an all-gather (world x the bytes of an all-reduce's
reduce-scatter half) and a sum per row-parallel linear.
"""

from __future__ import annotations

import torch


def ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """`parts[world, ...]` summed over dim 0 in index order, in FP32, rounded once to `parts.dtype`."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts.dtype)


def ordered_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over `group`'s ranks, in rank order (`ordered_sum`), on every rank; a new tensor."""
    world = torch.distributed.get_world_size(group)
    parts = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    torch.distributed.all_gather_into_tensor(parts.view(world * x.shape[0], *x.shape[1:]), x.contiguous(), group=group)
    return ordered_sum(parts)


class OrderedAllReduce(torch.autograd.Function):
    """`ordered_all_reduce` forward; the gradient passes through unchanged, as megatron's
    `reduce_from_tensor_model_parallel_region` passes it (every rank's partial output feeds the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        return ordered_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
