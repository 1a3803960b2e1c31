"""The Jet-RL FP8 linear: one forward for training FProp and rollout, FP8 DGrad and WGrad.

Numerics are described once in `megatron_jetrl.fp8`. In short, for Y = X W^T + b:
FProp X(1x128) . W(128x128); DGrad dY(1x128) . W with the same weight bytes; WGrad dY^T(128x1) . X(128x1),
X being the FP8 activation saved by the forward, re-quantized along tokens; under megatron DDP the WGrad
product lands in the parameter's FP32 `main_grad` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron_jetrl.fp8 import finite, kernels
from megatron_jetrl.fp8.flow import PrecisionFlow
from megatron_jetrl.fp8.gemm import blockwise_gemm
from megatron_jetrl.fp8.quant import dequantize_blockwise, quantize_blockwise
from megatron_jetrl.fp8.sequence_parallel import (
    NO_OVERLAP,
    SPOverlap,
    gather_rows,
    gathered_matmul,
    gathered_shape,
    matmul_scattered,
    scales_like,
)

ACT = (1, 128)
TOKENS = (128, 1)
TOKENS_T = (1, 128)  # WGrad's B operand: 128x1 token groups, stored transposed (K-major), so 1x128 along its rows
WEIGHT = (128, 128)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] as E4M3 bytes and its 128x128 dequant scales (`weight_scale_inv`)."""

    q: torch.Tensor
    s: torch.Tensor
    _t: tuple | None = field(default=None, compare=False, repr=False)
    keep_t: bool = field(default=True, compare=False, repr=False)
    """Whether `transposed()` keeps the W^T bytes it makes (False: made anew at each call and left to the caller)."""

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, flow: PrecisionFlow, *, site: str | None = None, transposed: bool = False, keep_t: bool = True
    ) -> QuantizedWeight:
        """Quantize `weight` once (per optimizer step). `transposed=True` also makes DGrad's W^T bytes now, in the
        same pass on CUDA; `keep_t=False` makes them at each DGrad instead and keeps none (less memory held). Non-finite weights: recorded under `check_finite="step"` inside a step's watch, else
        refused on the spot (outside a step a weight is quantized for export or sync, never per token)."""
        w = weight.detach()
        check = flow.check_finite
        site = site or f"FP8 linear {list(w.shape)}"
        sync = check == "sync" or (check == "step" and not finite.active())
        if transposed and _fast(w) and w.dim() == 2:
            q, s, qt, st = kernels.quantize_128x128(w, flow.scale_mode, eps=flow.eps, check_finite=sync, transposed=True)
            t = (qt, st)
        else:
            q, s = _quantize(w, WEIGHT, flow, sync)
            t = (q.t().contiguous(), s.t().contiguous()) if transposed else None
        _record(flow, f"{site}: weight", s)
        return cls(q, s, t if keep_t else None, keep_t)

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^T's bytes [K, N] (contiguous, K-major for DGrad) and scales: made once per weight and cached, or (`keep_t`
        False) made at each call.

        A 128x128 tile has one scale, so these are exactly the bytes and scales of quantizing W^T.
        """
        if self._t is not None:
            return self._t
        t = (kernels.transpose_bytes(self.q) if _fast(self.q) else self.q.t().contiguous(), self.s.t().contiguous())
        if self.keep_t:
            object.__setattr__(self, "_t", t)
        return t


def _fast(x: torch.Tensor) -> bool:
    """Whether the Triton quantizers (byte-identical to the reference, tests/gpu) serve this tensor."""
    return kernels.tensor_supported(x)


def _quantize(x, block, flow, sync: bool):
    """`quantize_blockwise` bytes (Triton kernels on CUDA); `sync`: refuse NaN/Inf now (one host sync)."""
    if _fast(x) and (x.dim() == 2 or tuple(block) == ACT):
        return kernels.quantize(x, block, flow.scale_mode, eps=flow.eps, check_finite=sync)
    return quantize_blockwise(x, block, flow.scale_mode, eps=flow.eps, check_finite=sync)


def _record(flow: PrecisionFlow, site: str, scales: torch.Tensor) -> None:
    """Under `check_finite="step"`: the quantization's scales go to the active watch (`megatron_jetrl.fp8.finite`)."""
    if flow.check_finite == "step":
        finite.record(site, scales)


def _quantize_input(x2d, flow: PrecisionFlow, site: str):
    """1x128 quantization of a GEMM input under `flow.check_finite` (see `megatron_jetrl.fp8.finite`)."""
    x_q, x_s = _quantize(x2d, ACT, flow, flow.check_finite == "sync")
    _record(flow, f"{site}: input", x_s)
    return x_q, x_s


def _fprop(x_q, x_s, weight: QuantizedWeight, bias, flow: PrecisionFlow, out_dtype):
    """FProp from the quantized input: X(1x128) . W(128x128)^T (+ bias), in `out_dtype`."""
    y = blockwise_gemm(
        x_q, x_s, weight.q, weight.s, b_block=WEIGHT, out_dtype=out_dtype, backend=flow.backend, checked=True, sms=flow.gemm_sms
    )
    return y if bias is None else y + bias.to(out_dtype)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """`x[..., K]` as the 2-D `[tokens, K]` a GEMM takes (2-D input as is: no dispatch on the hot path)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unflat(y: torch.Tensor, like: torch.Size) -> torch.Tensor:
    """A GEMM's fresh 2-D output `[tokens, N]` shaped as the input `like[..., K]` was (`[..., N]`)."""
    return y if len(like) == 2 else y.view(*like[:-1], y.shape[-1])


def _gathered_grad(dy_local2d, flow: PrecisionFlow, group, rows: bool, cols: bool):
    """`_quantize_grad` of the whole sequence's output gradient from this rank's rows: the BF16 rows are all-gathered
    (one collective, megatron's for a row-parallel backward) and quantized whole. Gathering each rank's quantized rows
    instead would move about as many bytes (E4M3 bytes and scales of both layouts, ~2.06 bytes an element) in four
    collectives and a transposing copy of the token-grouped bytes."""
    world = torch.distributed.get_world_size(group)
    full = torch.empty((world * dy_local2d.shape[0], dy_local2d.shape[1]), dtype=dy_local2d.dtype, device=dy_local2d.device)
    torch.distributed.all_gather_into_tensor(full, dy_local2d.contiguous(), group=group)
    return _quantize_grad(full, flow, rows, cols)


def _fprop_sp(x_q, x_s, weight: QuantizedWeight, bias, flow, x_shape, out_dtype, sp_group, rs_group, overlap: SPOverlap):
    """FProp of `x_q`, `x_s` (the quantized `x[x_shape]`): the sequence gathered over `sp_group` first, or the output
    reduce-scattered over `rs_group` (bias-free), overlapped as `overlap` says; returns `y` and its shape."""
    mm = lambda q, s: _fprop(q, s, weight, bias, flow, out_dtype)  # noqa: E731
    n = weight.q.shape[0]
    if sp_group is not None:
        y = gathered_matmul(x_q, x_s, mm, sp_group, overlap, n, out_dtype)
        return y, gathered_shape(x_shape, torch.distributed.get_world_size(sp_group))
    if rs_group is not None:
        y = matmul_scattered(x_q, x_s, mm, rs_group, overlap, n, out_dtype)
        return y, torch.Size((x_shape[0] // torch.distributed.get_world_size(rs_group), *x_shape[1:]))
    return mm(x_q, x_s), x_shape


def fp8_linear_forward(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias=None,
    *,
    flow: PrecisionFlow,
    site: str | None = None,
    gated_act=None,
    sp_group=None,
    rs_group=None,
    sp_overlap: SPOverlap = NO_OVERLAP,
) -> torch.Tensor:
    """The FP8 forward shared by training FProp and rollout: `x[..., K] -> y[..., N]` in `x.dtype`; with `gated_act`,
    `x` is a gated MLP's `[gate | up]`, with `sp_group` this rank's sequence shard, with `rs_group` the output
    reduce-scattered, the communication overlapped as `sp_overlap` says (as in `fp8_linear`)."""
    x_q, x_s = _quantize_x(_flat(x), gated_act, flow, site or f"FP8 linear {list(weight.q.shape)}")
    y, shape = _fprop_sp(x_q, x_s, weight, bias, flow, x.shape, x.dtype, sp_group, rs_group, sp_overlap)
    return _unflat(y, shape)


def fp8_linears_forward(x: torch.Tensor, weights, biases, *, flow: PrecisionFlow, site: str | None = None) -> list[torch.Tensor]:
    """FProp of several weights that read the same `x` (q/k/v, gate/up): `x` is quantized once, and each
    output is, bit for bit, what `fp8_linear_forward(x, weight, bias)` returns."""
    x_q, x_s = _quantize_input(_flat(x), flow, site or f"FP8 linears {[list(w.q.shape) for w in weights]}")
    return [_unflat(_fprop(x_q, x_s, weight, bias, flow, x.dtype), x.shape) for weight, bias in zip(weights, biases, strict=True)]


def wgrad_in_main_grad(weight: torch.Tensor):
    """What backward returns for a weight whose gradient went straight into `main_grad`: megatron's protocol
    (`grad_added_to_main_grad` + a placeholder its DDP hook drops), or None outside megatron DDP."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):  # a weight with another use (tied embeddings): its .grad is summed
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)  # and DDP adds it, so a true zero
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _quantize_x(x2d, act, flow: PrecisionFlow, site: str):
    """The FProp input's 1x128 bytes: of `x2d`, or with a gated `act` of `act(gate) * up` from `x2d = [gate | up]`."""
    return _quantize_input(x2d, flow, site) if act is None else _quantize_gated(x2d, act, flow, site)


def _quantize_gated(gate_up2d, act, flow: PrecisionFlow, site: str):
    """1x128 quantization of `act(gate) * up` from `gate_up = [gate | up]`. With torch's SiLU on CUDA one Triton
    kernel reads gate_up and writes the bytes (the BF16 product is never stored; tests/gpu: the bytes of
    quantizing torch's `silu(g) * u`); otherwise the product is formed as megatron's MLP forms it."""
    sync = flow.check_finite == "sync"
    if act is F.silu and _fast(gate_up2d):
        q, s = kernels.swiglu_quantize_1x128(gate_up2d, flow.scale_mode, eps=flow.eps, check_finite=sync)
        _record(flow, f"{site}: input", s)
        return q, s
    gate, up = gate_up2d.chunk(2, dim=-1)
    return _quantize_input(act(gate) * up, flow, site)


def _gated_backward(gate_up, act, d_out):
    """d[gate | up] of `act(gate) * up`, bit for bit what torch's autograd of those ops gives (megatron's MLP backward).

    For SiLU these are autograd's own three ops, written into the halves of one [.., 2I] buffer: MulBackward's
    `d_out * up` and `d_out * silu(gate)`, then SiluBackward's `silu_backward`. That skips autograd's recomputed
    product `silu(gate) * up` and the final `cat` (two passes over [T, I] and [T, 2I]); on CUDA one Triton kernel
    computes the same ops in one pass (`kernels.swiglu_backward`). Other activations go through autograd itself."""
    if _silu_kernels(gate_up, act, d_out):  # the same ops, one Triton pass
        return kernels.swiglu_backward(gate_up, d_out)
    gate, up = gate_up.chunk(2, dim=-1)
    if act is F.silu:
        d = torch.empty_like(gate_up)
        d_gate, d_up = d.chunk(2, dim=-1)
        torch.mul(d_out, F.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(d_out * up, gate, grad_input=d_gate)
        return d
    with torch.enable_grad():
        gate, up = (t.detach().requires_grad_(True) for t in (gate, up))
        d_gate, d_up = torch.autograd.grad(act(gate) * up, (gate, up), d_out)
    return torch.cat([d_gate, d_up], dim=-1)


def _silu_kernels(gate_up, act, d_out) -> bool:
    """Whether the SwiGLU backward runs as the CUDA kernels of `fp8/kernels.py` (SiLU, unit last strides)."""
    return act is F.silu and _fast(d_out) and d_out.stride(-1) == 1 and gate_up.stride(-1) == 1


def _quantize_gated_grad(gate_up, act, d_out, flow: PrecisionFlow, rows: bool, cols: bool):
    """`_quantize_grad(_gated_backward(gate_up, act, d_out), ...)`; for SiLU on CUDA one call of
    `kernels.swiglu_backward_dual`, whose "cuda" mode never stores d[gate | up] in BF16."""
    if _silu_kernels(gate_up, act, d_out):
        return kernels.swiglu_backward_dual(gate_up, d_out, flow.scale_mode, eps=flow.eps, rows=rows, cols=cols)
    return _quantize_grad(_gated_backward(gate_up, act, d_out), flow, rows, cols)


class GatedGradHandoff:
    """d[gate | up] of a gated MLP, handed as FP8 from the down projection's backward to the up projection's.

    The up projection's output `[gate | up]` is the down projection's input and nothing else's (the caller's
    promise: `FP8GatedMLP` with a bias-free up projection). The down projection's backward then makes the up
    projection's DGrad (1x128) and WGrad (128x1) bytes of d[gate | up] itself (`_quantize_gated_grad`) and gives
    autograd a zero-stride placeholder of the right shape; the up projection's backward takes the bytes when that
    very placeholder arrives. Any other gradient arriving while bytes wait means an op came between the two, and
    is refused. The bytes are those the up projection would have made from the BF16 gradient (tests/unit)."""

    def __init__(self):
        self.rows = self.cols = True  # which operands the up projection's backward needs (set by its forward)
        self._token: torch.Tensor | None = None
        self._grads: tuple | None = None

    def give(self, grads: tuple, shape, dtype, device) -> torch.Tensor:
        self._grads = grads
        self._token = torch.empty(1, dtype=dtype, device=device)
        return self._token.expand(shape)

    def take(self, dy: torch.Tensor) -> tuple | None:
        if self._grads is None:
            return None
        if any(dy.stride()) or dy.untyped_storage().data_ptr() != self._token.untyped_storage().data_ptr():
            raise RuntimeError(
                "the gated MLP's up projection received a gradient other than the down projection's "
                "FP8 handoff: an op between the two changed d[gate | up]. Build the MLP without "
                "GatedGradHandoff when its [gate | up] output is used elsewhere"
            )
        grads, self._grads, self._token = self._grads, None, None
        return grads


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        qweight: QuantizedWeight,
        flow: PrecisionFlow,
        site: str,
        act=None,
        handoff: GatedGradHandoff | None = None,
        dgrad_group=None,
        sp_group=None,
        rs_group=None,
        sp_overlap: SPOverlap = NO_OVERLAP,
    ):
        x2d = _flat(x)
        x_q, x_s = _quantize_x(x2d, act, flow, site)
        if act is None:
            ctx.save_for_backward(x_q, x_s)  # under sequence parallelism this rank's rows only, gathered again for WGrad
        else:  # x = [gate | up] of a gated MLP: this linear's input is act(gate) * up, never stored in BF16
            ctx.save_for_backward(x_q, x_s, x2d)
        y, out_shape = _fprop_sp(x_q, x_s, qweight, bias, flow, x.shape, x.dtype, sp_group, rs_group, sp_overlap)
        ctx.qweight, ctx.weight, ctx.flow, ctx.site, ctx.act, ctx.handoff = qweight, weight, flow, site, act, handoff
        ctx.dgrad_group, ctx.sp_group, ctx.rs_group = dgrad_group, sp_group, rs_group
        if handoff is not None and act is None:  # the up projection: tell the down projection what to make
            handoff.rows, handoff.cols = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.has_bias = bias is not None
        return _unflat(y, out_shape)

    @staticmethod
    def backward(ctx, dy):
        # Gradients are never refused mid-backward: a NaN/Inf output gradient is recorded under
        # check_finite="step" (naming this layer) and propagates as NaN into the parameter gradients, where
        # train_step's one finiteness check finds it and stops or skips the update (run.on_nonfinite).
        saved = ctx.saved_tensors
        x_q, x_s = saved[:2]
        flow, weight = ctx.flow, ctx.weight
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathering = None
        if ctx.sp_group is not None and need_dw:  # WGrad's rows from every rank, in flight while DGrad runs
            gathering = gather_rows(x_q, x_s, ctx.sp_group, async_op=True)
        handed = ctx.handoff.take(dy) if ctx.handoff is not None and ctx.act is None else None
        dy2d = _flat(dy)
        dx = dw = db = None
        if need_dx or need_dw:  # (only the bias may need a gradient: then dY is not quantized)
            if handed is not None:
                dy_q, dy_s, dyt_q, dyt_s = handed
            elif ctx.rs_group is not None:  # this rank's rows of dY: the whole sequence's gathered, then quantized
                dy_q, dy_s, dyt_q, dyt_s = _gathered_grad(dy2d, flow, ctx.rs_group, need_dx, need_dw)
            else:
                dy_q, dy_s, dyt_q, dyt_s = _quantize_grad(dy2d, flow, need_dx, need_dw)
            _record(flow, f"{ctx.site}: output gradient", dy_s if need_dx else dyt_s)
        if need_dx:  # DGrad: dY(1x128 along N) . W, with W^T's bytes made once per weight version
            wt_q, wt_s = ctx.qweight.transposed()
            dx = blockwise_gemm(
                dy_q,
                dy_s,
                wt_q,
                wt_s,
                b_block=WEIGHT,
                out_dtype=ctx.x_dtype,
                backend=flow.backend,
                checked=True,
                sms=flow.gemm_sms,
            )
            if ctx.act is not None and ctx.handoff is not None:  # the up projection's operands, made here
                h = ctx.handoff
                dx = h.give(_quantize_gated_grad(saved[2], ctx.act, dx, flow, h.rows, h.cols), ctx.x_shape, dx.dtype, dx.device)
            elif ctx.act is not None:
                dx = _gated_backward(saved[2], ctx.act, dx).reshape(ctx.x_shape)  # (empty_like keeps gate_up's strides)
            elif ctx.sp_group is None:
                dx = _unflat(dx, ctx.x_shape)
        reduce = None
        if need_dx and ctx.dgrad_group is not None:  # the input's gradient summed over the TP group while WGrad runs
            reduce = torch.distributed.all_reduce(dx, group=ctx.dgrad_group, async_op=True)
        elif need_dx and ctx.sp_group is not None:  # summed over the TP group and this rank's rows kept, while WGrad runs
            full = dx
            dx = torch.empty((ctx.x_shape.numel() // ctx.x_shape[-1], full.shape[1]), dtype=full.dtype, device=full.device)
            reduce = torch.distributed.reduce_scatter_tensor(dx, full, group=ctx.sp_group, async_op=True)
            dx = dx.view(ctx.x_shape)
        if need_dw:  # WGrad: both operands grouped along tokens, K-major [features, tokens]
            if gathering is not None:
                x_q, gathered_s, works = gathering
                for work in works:
                    work.wait()
                x_s = scales_like(gathered_s, x_s)
            xt_q, xt_s = _requantize_tokens(x_q, x_s, flow)
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is not None:  # megatron DDP's FP32 buffer: accumulate in place (fused on DeepGEMM)
                blockwise_gemm(
                    dyt_q,
                    dyt_s,
                    xt_q,
                    xt_s,
                    b_block=TOKENS_T,
                    backend=flow.backend,
                    acc=main_grad,
                    checked=True,
                    sms=flow.gemm_sms,
                )
                dw = wgrad_in_main_grad(weight)
            else:
                dw = blockwise_gemm(
                    dyt_q,
                    dyt_s,
                    xt_q,
                    xt_s,
                    b_block=TOKENS_T,
                    out_dtype=weight.dtype,
                    backend=flow.backend,
                    checked=True,
                    sms=flow.gemm_sms,
                )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(weight.dtype)
        if reduce is not None:
            reduce.wait()
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def _quantize_grad(dy2d, flow, rows: bool, cols: bool):
    """dY's 1x128 bytes (DGrad) and its 128x1 bytes transposed to [N, T] (WGrad). On CUDA one kernel call
    gives both (tests/gpu/test_kernels.py: the reference's bytes)."""
    if _fast(dy2d):
        return kernels.quantize_dual(dy2d, flow.scale_mode, eps=flow.eps, check_finite=False, rows=rows, cols=cols)
    dy_q = dy_s = dyt_q = dyt_s = None
    if rows:
        dy_q, dy_s = quantize_blockwise(dy2d, ACT, flow.scale_mode, eps=flow.eps, check_finite=False)
    if cols:
        q, s = quantize_blockwise(dy2d, TOKENS, flow.scale_mode, eps=flow.eps, check_finite=False)
        dyt_q, dyt_s = q.t(), s.t()
    return dy_q, dy_s, dyt_q, dyt_s


def _requantize_tokens(x_q, x_s, flow):
    """The saved FP8 activation dequantized in FP32 (q * s) and re-quantized along tokens, as [K, T] K-major."""
    if _fast(x_q):
        _, _, xt_q, xt_s = kernels.quantize_dual(x_q, flow.scale_mode, eps=flow.eps, check_finite=False, rows=False, x_scale=x_s)
        return xt_q, xt_s
    x_hat = dequantize_blockwise(x_q, x_s, ACT)
    q, s = quantize_blockwise(x_hat, TOKENS, flow.scale_mode, eps=flow.eps, check_finite=False)
    return q.t(), s.t()


def fp8_linear(
    x,
    weight,
    bias=None,
    *,
    flow: PrecisionFlow,
    weight_q: QuantizedWeight | None = None,
    site: str | None = None,
    gated_act=None,
    handoff: GatedGradHandoff | None = None,
    dgrad_group=None,
    sp_group=None,
    rs_group=None,
    sp_overlap: SPOverlap = NO_OVERLAP,
):
    """Functional linear in the training precision of `flow` (FP8 in `jetrl`, plain otherwise).

    Pass `weight_q` to reuse a weight quantized once per optimizer step; `site` names the layer in non-finite
    reports. WGrad goes straight into `weight.main_grad` when the weight has one (megatron DDP). With
    `gated_act`, `x` is a gated MLP's `[gate | up]` and the linear's input is `gated_act(gate) * up`, fused
    into the input quantization (the down projection of a SwiGLU MLP). One `handoff` given to both linears of
    such an MLP (up projection bias-free, its output feeding only the down projection) moves the quantization of
    d[gate | up] into the down projection's backward (`GatedGradHandoff`). With `dgrad_group` (a column-parallel
    linear's TP group) the input's gradient is all-reduced over it in the backward, started as soon as DGrad has made it
    and waited for after WGrad, which runs meanwhile (megatron's BF16 linear overlaps the two the same way).

    With `sp_group` (a column-parallel linear under sequence parallelism) `x` is this rank's shard of the sequence
    (dim 0) and the output covers the whole sequence: each rank quantizes its own rows and the group all-gathers the
    FP8 bytes and scales (`gather_rows`: the bytes of quantizing the gathered BF16, about half its bytes on the
    wire); the backward gathers them again for WGrad (while DGrad runs; only this rank's rows are saved) and
    reduce-scatters the input's gradient to this rank's rows while WGrad runs. With `rs_group` (a row-parallel linear
    under sequence parallelism) the output is summed over the group and this rank's rows of the sequence kept
    (reduce-scatter), and the backward all-gathers the output gradient's BF16 rows (megatron's collective) and
    quantizes the whole sequence (`_gathered_grad`). A bias is then added by the caller, after the sum. `sp_overlap` says how
    the forward's gather or reduce-scatter overlaps its GEMM (`fp8.sequence_parallel.SPOverlap`: in pieces, or round
    the ring): the gathered output is the one-collective one's to the bit, the reduce-scattered one sums in the order
    of the collective it uses; the backward is the same for all.
    """
    if rs_group is not None and (sp_group is not None or dgrad_group is not None or bias is not None or not flow.train_fp8):
        raise ValueError(
            "rs_group reduce-scatters a row-parallel FP8 linear's output: it takes no sp_group or dgrad_group, no bias "
            f"(added after the sum) and an FP8 training flow (mode {flow.mode!r}: reduce-scatter outside, megatron's "
            "reduce_scatter_to_sequence_parallel_region)"
        )
    if sp_group is not None and (dgrad_group is not None or gated_act is not None or not flow.train_fp8):
        raise ValueError(
            "sp_group gathers a column-parallel FP8 linear's input along the sequence: it takes no dgrad_group (the "
            "gradient is reduce-scattered instead), no gated_act (a down projection is row-parallel) and an FP8 "
            f"training flow (mode {flow.mode!r}: gather the input outside, megatron's gather_from_sequence_parallel_region)"
        )
    if dgrad_group is not None and (not flow.train_fp8 or gated_act is not None):
        why = f"mode {flow.mode!r} trains in BF16" if not flow.train_fp8 else "a gated (down) projection is row-parallel"
        raise ValueError(
            f"dgrad_group all-reduces a column-parallel FP8 linear's input gradient; {why}: reduce the input's "
            "gradient outside (megatron's copy_to_tensor_model_parallel_region), if at all"
        )
    if not flow.train_fp8:
        if gated_act is not None:
            gate, up = x.chunk(2, dim=-1)
            x = gated_act(gate) * up
        return F.linear(x, weight, bias)
    site = site or f"FP8 linear {list(weight.shape)}"
    if weight_q is None:
        weight_q = QuantizedWeight.quantize(weight, flow, site=site, transposed=True)
    if handoff is not None and gated_act is None and bias is not None:
        raise ValueError(
            f"{site}: a GatedGradHandoff needs a bias-free up projection (its bias gradient needs the BF16 "
            "d[gate | up], which the handoff never makes); pass handoff=None"
        )
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))):
        # nothing to differentiate (old and reference logprobs under no_grad): the same forward without an autograd node
        return fp8_linear_forward(
            x,
            weight_q,
            bias,
            flow=flow,
            site=site,
            gated_act=gated_act,
            sp_group=sp_group,
            rs_group=rs_group,
            sp_overlap=sp_overlap,
        )
    return _FP8LinearFunction.apply(
        x, weight, bias, weight_q, flow, site, gated_act, handoff, dgrad_group, sp_group, rs_group, sp_overlap
    )


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
            self._cached = (key, QuantizedWeight.quantize(w, self.flow, transposed=self.flow.train_fp8 and w.requires_grad))
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
