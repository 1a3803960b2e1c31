"""Megatron's gradient accumulation fusion for the actor's BF16 linears, without apex.

`fuse_wgrad_accumulation(ddp)` switches megatron's own `ColumnParallelLinear` / `RowParallelLinear` layers of a
DDP-wrapped model to `gradient_accumulation_fusion`: their WGrad GEMM adds into the parameter's FP32 `main_grad`
(cuBLAS through torch, patches/megatron_core_0_16_1_wgrad_fusion.py) instead of writing a BF16 gradient that DDP's
hook adds afterwards. Those are the linears of bf16 mode and the lm_head of every mode, and under exact logprobs the
linears that run vLLM's GEMMs (`actor.rollout_kernels`, `takes_wgrad_fusion`: their backward honours the flag); the FP8
linears accumulate into `main_grad` themselves (fp8/linear.py). It runs after DDP because only then does every weight have its
`main_grad` (megatron's fused backward needs one).

Before any layer is switched, the GEMM is checked once per device and dtype against an FP64 reference on a small
problem. A torch that refuses an FP32 accumulator for BF16 operands, or returns other numbers, leaves the model
unfused (megatron's separate add, as before) with a warning that says why.
"""

from __future__ import annotations

import functools
import warnings

import torch

from megatron_jetrl.patching import load_patch

PATCH = "megatron_core_0_16_1_wgrad_fusion"


def fuse_wgrad_accumulation(ddp) -> int:
    """Switch the DDP-wrapped model's megatron linears to fused WGrad accumulation; returns how many were switched
    (0 when none has an FP32 `main_grad` or the device check fails)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    megatron_own = (ColumnParallelLinear, RowParallelLinear)  # not their FP8 subclasses: those accumulate themselves
    layers = [
        m
        for m in ddp.module.modules()
        if (type(m) in megatron_own or getattr(type(m), "takes_wgrad_fusion", False))
        and getattr(m.weight, "main_grad", None) is not None
    ]
    kinds = {(m.weight.device, m.weight.dtype, m.weight.main_grad.dtype) for m in layers}
    problems = [p for p in (_check(*kind) for kind in kinds) if p]
    if problems:
        warnings.warn(
            f"gradient accumulation fusion stays off ({'; '.join(problems)}): megatron adds each linear's "
            "weight gradient into main_grad separately",
            stacklevel=2,
        )
        return 0
    if layers:
        load_patch(PATCH).apply()
    for m in layers:
        m.gradient_accumulation_fusion = True
    return len(layers)


@functools.cache
def _check(device: torch.device, dtype: torch.dtype, acc_dtype: torch.dtype) -> str | None:
    """None if `wgrad_gemm_accum_fp32` computes acc + dy^T x on this device within FP32 summation error, else why not."""
    if acc_dtype != torch.float32:
        return f"main_grad is {acc_dtype}, the fused GEMM accumulates in float32 only"
    g = torch.Generator().manual_seed(0)
    x, dy, acc = (torch.randn(*shape, generator=g) for shape in ((512, 192), (512, 128), (128, 192)))
    x, dy = x.to(dtype), dy.to(dtype)
    ref = acc.double() + dy.double().t() @ x.double()
    bound = 512 * torch.finfo(torch.float32).eps * (acc.double().abs() + dy.double().abs().t() @ x.double().abs())
    out = acc.to(device)
    try:
        load_patch(PATCH).wgrad_gemm_accum_fp32(x.to(device), dy.to(device), out)
    except (RuntimeError, TypeError) as e:  # an older torch: no FP32 accumulator for BF16 operands
        return f"torch.addmm(out_dtype=float32) on {device}: {type(e).__name__}: {str(e)[:160]}"
    worst = float(((out.double().cpu() - ref).abs() / bound).max())
    if not worst <= 1:
        return f"the fused WGrad GEMM on {device} ({dtype}) is off by {worst:.3g}x the FP32 summation bound"
    return None
