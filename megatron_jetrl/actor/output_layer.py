"""GPTModel's output layer (lm_head) with token-major logits, and the linear autograd function it runs on.

megatron's GPTModel computes the logits `[s, b, V]` and returns `logits.transpose(0, 1).contiguous()`: a strided copy of
the largest tensor of a step (16 x 536 tokens x Qwen3's 151,936-token vocabulary: 2.6 GB in BF16), and its backward
makes the gradient contiguous again. `TokenMajorOutputLayer` runs the lm_head over the rows sample by sample instead
(`x[s, b, K]` read as `[b, s, K]`, a copy of the hidden states, V / K times smaller), so its output is a `[s, b, V]`
view of a `[b, s, V]`-contiguous tensor: GPTModel's transpose and `.contiguous()` then copy nothing, and the gradient
arrives in that layout too. A GEMM computes each row from that row and the weight alone, and the product has the
same shape either way, so the logits are those of the `[s, b]` order (tests/unit: to the bit on the CPU).
Every actor gets it but the two that replace the output layer themselves (`batch_invariant`, `rollout_kernels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear

from megatron_jetrl.actor.fp8_layers import _column_parallel_input
from megatron_jetrl.actor.wgrad_fusion import PATCH as WGRAD_PATCH
from megatron_jetrl.fp8.linear import wgrad_in_main_grad
from megatron_jetrl.patching import load_patch


class GemmLinear(torch.autograd.Function):
    """`x @ w.T` with the forward GEMM `gemm(x2d, w)` given; plain torch GEMMs backward. `fuse`: WGrad adds into the
    weight's FP32 `main_grad` (megatron DDP) in the GEMM, as megatron's BF16 linears do under
    `gradient_accumulation_fusion` (`actor.wgrad_fusion`), instead of a BF16 gradient DDP adds afterwards. `token_major`
    (an lm_head, `x[s, b, K]`): the rows run sample by sample, so the output is a `[s, b, N]` view of a
    `[b, s, N]`-contiguous tensor (module docstring); its gradient arrives in that layout too."""

    @staticmethod
    def forward(ctx, x, weight, gemm, fuse: bool, token_major: bool):
        ctx.fuse, ctx.token_major, ctx.shape = fuse, token_major and x.dim() == 3, x.shape
        x2d = x.transpose(0, 1).reshape(-1, x.shape[-1]) if ctx.token_major else x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        y = gemm(x2d, weight)
        if ctx.token_major:
            return y.view(x.shape[1], x.shape[0], -1).transpose(0, 1)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        g2 = (grad.transpose(0, 1) if ctx.token_major else grad).reshape(-1, grad.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g2 @ weight
            if ctx.token_major:  # contiguous: megatron all-reduces `x.contiguous()` in place of x under TP
                dx = dx.view(ctx.shape[1], ctx.shape[0], -1).transpose(0, 1).contiguous()
            else:
                dx = dx.view(ctx.shape)
        if ctx.needs_input_grad[1]:
            main_grad = getattr(weight, "main_grad", None)
            if ctx.fuse and main_grad is not None:
                load_patch(WGRAD_PATCH).wgrad_gemm_accum_fp32(x2d, g2, main_grad)
                dw = wgrad_in_main_grad(weight)
            else:
                dw = g2.t() @ x2d
        return dx, dw, None, None, None


def torch_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` as megatron's BF16 linear computes it (cuBLAS through torch)."""
    return F.linear(x, weight)


class TokenMajorOutputLayer(ColumnParallelLinear):
    """megatron `ColumnParallelLinear` (TP semantics unchanged: vocabulary-parallel logits, the input's gradient
    all-reduced or reduce-scattered) whose logits are token-major (module docstring)."""

    gemm = staticmethod(torch_gemm)
    token_major = True
    takes_wgrad_fusion = True  # `actor.wgrad_fusion` may switch its gradient_accumulation_fusion on (`GemmLinear`'s fuse)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **_):
        x = _column_parallel_input(self, input, allreduce_dgrad, sequence_parallel)
        y = GemmLinear.apply(x, weight, self.gemm, gradient_accumulation_fusion, self.token_major)
        return y if bias is None else y + bias


def use_output_layer(model, cls: type[ColumnParallelLinear]) -> None:
    """Re-class this stage's GPTModel output layer (if it has one) as `cls`: same state, same TP semantics (GPTModel
    builds the layer itself, so the instance is re-classed)."""
    layer = getattr(model, "output_layer", None)
    if layer is not None:
        if type(layer) is not ColumnParallelLinear:
            raise TypeError(f"expected GPTModel's ColumnParallelLinear output layer, got {type(layer).__name__}")
        layer.__class__ = cls
