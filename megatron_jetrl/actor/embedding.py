"""The token embedding's weight gradient, added row by row into megatron DDP's FP32 `main_grad`.

megatron's `VocabParallelEmbedding` looks rows up with `F.embedding`, whose backward writes a dense `[vocab, hidden]`
gradient in the weight's dtype for every micro-batch: zero-filled, a few thousand rows scattered into it, then added
into `main_grad` by DDP's hook. For Qwen3-8B (151,936 x 4,096) that is 1.2 GB written and ~7 GB moved per micro-batch,
about 2 ms on an H200, on the pipeline's first stage. Here the lookup's backward adds each token's output-gradient row
into its `main_grad` row instead (`index_put_` with accumulation: in FP32, and in a fixed order on CUDA, where
duplicate indices are sorted first), and answers megatron's fused-gradient protocol (`fp8.linear.wgrad_in_main_grad`).
A weight without a `main_grad` gets the dense gradient as before, summed in FP32.

The forward is megatron's: ids outside this rank's vocabulary shard look up row 0 and are zeroed, then the TP ranks'
rows are summed (all-reduce, or reduce-scatter along the sequence under sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_jetrl.fp8.linear import wgrad_in_main_grad


class _LookupIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        index, rows = (ids.reshape(-1),), dy.reshape(-1, dy.shape[-1]).float()
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            dense = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device).index_put_(index, rows, accumulate=True)
            return None, dense.to(weight.dtype)
        main_grad.index_put_(index, rows.to(main_grad.dtype), accumulate=True)
        return None, wgrad_in_main_grad(weight)


class MainGradEmbedding(VocabParallelEmbedding):
    """megatron's `VocabParallelEmbedding` whose weight gradient goes row by row into `main_grad` (module docstring)."""

    def forward(self, input_):
        outside = None
        ids = input_
        if self.tp_group.size() > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = torch.where(outside, 0, input_ - self.vocab_start_index)
        out = _LookupIntoMainGrad.apply(ids, self.weight)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:  # [b, s, h] -> [s, b, h], this rank's rows of the summed sequence
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


def use_main_grad_embedding(model) -> bool:
    """Re-class this stage's word embedding (if it holds one) as `MainGradEmbedding`: same parameters, same forward
    bytes. Returns whether it had one."""
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is None:
        return False
    if type(embedding) is not VocabParallelEmbedding:
        raise TypeError(f"expected megatron's VocabParallelEmbedding, got {type(embedding).__name__}")
    embedding.__class__ = MainGradEmbedding
    return True
