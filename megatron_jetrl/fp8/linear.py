"""The Jet-RL FP8 linear: one forward for training FProp and rollout, FP8 DGrad and WGrad.

Numerics are described once in `megatron_jetrl.fp8`. In short, for Y = X W^T + b:
FProp X(1x128) . W(128x128); DGrad dY(1x128) . W with the same weight bytes; WGrad dY^T(128x1) . X(128x1),
X being the FP8 activation saved by the forward, re-quantized along tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron_jetrl.fp8.flow import PrecisionFlow
from megatron_jetrl.fp8.gemm import blockwise_gemm
from megatron_jetrl.fp8.quant import dequantize_blockwise, quantize_blockwise

ACT = (1, 128)
TOKENS = (128, 1)
WEIGHT = (128, 128)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] as E4M3 bytes and its 128x128 dequant scales (`weight_scale_inv`)."""

    q: torch.Tensor
    s: torch.Tensor
    _t: tuple | None = field(default=None, compare=False, repr=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, flow: PrecisionFlow) -> "QuantizedWeight":
        q, s = _quantize(weight.detach(), WEIGHT, flow)
        return cls(q, s)

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^T's bytes [K, N] (contiguous, K-major for DGrad) and scales: a byte copy, cached with this weight.

        A 128x128 tile has one scale, so these are exactly the bytes and scales of quantizing W^T.
        """
        if self._t is None:
            object.__setattr__(self, "_t", (self.q.t().contiguous(), self.s.t().contiguous()))
        return self._t


def _fast(x: torch.Tensor) -> bool:
    """Whether the Triton quantizers (byte-identical to the reference, tests/gpu) serve this tensor."""
    if x.device.type != "cuda":
        return False
    from megatron_jetrl.fp8 import kernels

    return kernels.supported(x.device)


def _quantize(x, block, flow, check_finite=None):
    check_finite = flow.check_finite if check_finite is None else check_finite
    if _fast(x) and (x.dim() == 2 or tuple(block) == ACT):
        from megatron_jetrl.fp8 import kernels

        return kernels.quantize(x, block, flow.scale_mode, eps=flow.eps, check_finite=check_finite)
    return quantize_blockwise(x, block, flow.scale_mode, eps=flow.eps, check_finite=check_finite)


def _fprop(x2d, weight: QuantizedWeight, bias, flow: PrecisionFlow, out_dtype):
    x_q, x_s = _quantize(x2d, ACT, flow)
    y = blockwise_gemm(x_q, x_s, weight.q, weight.s, b_block=WEIGHT, out_dtype=out_dtype, backend=flow.backend)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y, x_q, x_s


def fp8_linear_forward(x: torch.Tensor, weight: QuantizedWeight, bias=None, *, flow: PrecisionFlow) -> torch.Tensor:
    """The FP8 forward shared by training FProp and rollout: `x[..., K] -> y[..., N]` in `x.dtype`."""
    y, _, _ = _fprop(x.reshape(-1, x.shape[-1]), weight, bias, flow, x.dtype)
    return y.reshape(*x.shape[:-1], weight.q.shape[0])


def fp8_linears_forward(x: torch.Tensor, weights, biases, *, flow: PrecisionFlow) -> list[torch.Tensor]:
    """FProp of several weights that read the same `x` (q/k/v, gate/up): `x` is quantized once, and each
    output is, bit for bit, what `fp8_linear_forward(x, weight, bias)` returns."""
    x2d = x.reshape(-1, x.shape[-1])
    x_q, x_s = _quantize(x2d, ACT, flow)
    outs = []
    for weight, bias in zip(weights, biases, strict=True):
        y = blockwise_gemm(x_q, x_s, weight.q, weight.s, b_block=WEIGHT, out_dtype=x.dtype, backend=flow.backend)
        if bias is not None:
            y = y + bias.to(x.dtype)
        outs.append(y.reshape(*x.shape[:-1], weight.q.shape[0]))
    return outs


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_q, weight_s, flow, qweight=None):
        x2d = x.reshape(-1, x.shape[-1])
        y, x_q, x_s = _fprop(x2d, QuantizedWeight(weight_q, weight_s), bias, flow, x.dtype)
        ctx.save_for_backward(x_q, x_s, weight_q, weight_s)
        ctx.qweight = qweight  # the cached QuantizedWeight (holds W^T bytes for DGrad once made)
        ctx.flow, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = flow, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight_q.shape[0])

    @staticmethod
    def backward(ctx, dy):
        # Gradients are quantized without the finiteness check: a NaN/Inf gradient propagates as NaN into the
        # parameter gradients, where train_step's collective check finds it, names it and stops or skips the
        # update (run.on_nonfinite). The activations were checked in the forward.
        x_q, x_s, w_q, w_s = ctx.saved_tensors
        flow = ctx.flow
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if _fast(dy2d):
            # One pass over dY gives both its 1x128 (DGrad) and its transposed 128x1 (WGrad) bytes, and X is
            # re-quantized along tokens straight from its saved E4M3 bytes and scales; the bytes are those of
            # the reference path below (tests/gpu/test_kernels.py).
            from megatron_jetrl.fp8 import kernels

            q_kw = dict(eps=flow.eps, check_finite=False)
            dy_q, dy_s, dyt_q, dyt_s = kernels.quantize_dual(dy2d, flow.scale_mode, rows=need_dx, cols=need_dw, **q_kw)
            if need_dx:
                wt_q, wt_s = ctx.qweight.transposed() if ctx.qweight is not None else (w_q.t().contiguous(), w_s.t())
                dx = blockwise_gemm(dy_q, dy_s, wt_q, wt_s, b_block=WEIGHT, out_dtype=ctx.x_dtype, backend=flow.backend)
                dx = dx.reshape(ctx.x_shape)
            if need_dw:
                _, _, xt_q, xt_s = kernels.quantize_dual(x_q, flow.scale_mode, rows=False, x_scale=x_s, **q_kw)
                dw = blockwise_gemm(dyt_q, dyt_s, xt_q, xt_s, b_block=(1, 128), out_dtype=ctx.w_dtype, backend=flow.backend)
        else:
            if need_dx:  # DGrad: dY(1x128 along N) . W, W's blocks used transposed
                dy_q, dy_s = _quantize(dy2d, ACT, flow, check_finite=False)
                dx = blockwise_gemm(dy_q, dy_s, w_q.t(), w_s.t(), b_block=WEIGHT, out_dtype=ctx.x_dtype, backend=flow.backend)
                dx = dx.reshape(ctx.x_shape)
            if need_dw:  # WGrad: both operands grouped along tokens
                dyt_q, dyt_s = _quantize(dy2d, TOKENS, flow, check_finite=False)
                x_hat = dequantize_blockwise(x_q, x_s, ACT)
                xt_q, xt_s = _quantize(x_hat, TOKENS, flow, check_finite=False)
                dw = blockwise_gemm(
                    dyt_q.t(), dyt_s.t(), xt_q.t(), xt_s.t(), b_block=(1, 128), out_dtype=ctx.w_dtype, backend=flow.backend
                )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None, None, None


def fp8_linear(x, weight, bias=None, *, flow: PrecisionFlow, weight_q: QuantizedWeight | None = None):
    """Functional linear in the training precision of `flow` (FP8 in `jetrl`, plain otherwise).

    Pass `weight_q` to reuse a weight quantized once per optimizer step.
    """
    if not flow.train_fp8:
        return F.linear(x, weight, bias)
    if weight_q is None:
        weight_q = QuantizedWeight.quantize(weight, flow)
    return _FP8LinearFunction.apply(x, weight, bias, weight_q.q, weight_q.s, flow, weight_q)


class FP8Linear(torch.nn.Module):
    """`nn.Linear` in the precision of `flow`; its FP8 weight is quantized once per weight version."""

    def __init__(self, in_features, out_features, bias=True, *, flow: PrecisionFlow, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.flow = in_features, out_features, flow
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self._cached: tuple[tuple, QuantizedWeight] | None = None
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.bias is not None:
            bound = 1 / self.in_features**0.5
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def quantized_weight(self) -> QuantizedWeight:
        """The FP8 weight for the current weight version: optimizer steps (in-place) and `.data` swaps invalidate it."""
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, QuantizedWeight.quantize(w, self.flow))
        return self._cached[1]

    def forward(self, x):
        if not self.flow.train_fp8:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, flow=self.flow, weight_q=self.quantized_weight())

    def rollout_forward(self, x):
        """The rollout engine's forward: FP8 whenever the flow's rollout is FP8, through the same code."""
        if not self.flow.rollout_fp8:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear_forward(x, self.quantized_weight(), self.bias, flow=self.flow)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, mode={self.flow.mode}"
