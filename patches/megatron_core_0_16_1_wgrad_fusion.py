"""megatron-core **0.16.1**'s gradient accumulation fusion without apex (runtime patch).

Why: with `gradient_accumulation_fusion`, megatron's `ColumnParallelLinear` / `RowParallelLinear` backward adds the
weight gradient into the parameter's FP32 `main_grad` inside the WGrad GEMM, through apex's CUDA extension
`fused_weight_gradient_mlp_cuda` (`wgrad_gemm_accum_fp32(input, grad_output, main_grad)`). Without apex, the flag
is refused and every BF16 linear writes a BF16 gradient that megatron DDP's hook then adds into `main_grad`: one
more pass over the weight per micro-batch (an H200 actor step at 13 Qwen3-8B layers spent ~80 ms of 1.33 s there),
and the gradient is rounded to BF16 before it is accumulated.

torch >= 2.8 runs the same GEMM in cuBLAS: `torch.addmm(main_grad, dY^T, X, out_dtype=torch.float32,
out=main_grad)` (BF16 operands, FP32 C with beta = 1). `apply()` installs a stand-in for the extension in
`megatron.core.tensor_parallel.layers` (the module global its backward calls, and `_grad_accum_fusion_available`,
which its constructors check). It changes nothing else; `megatron_jetrl.actor.wgrad_fusion` decides which layers
use it, after checking the GEMM once on their device.
"""

from __future__ import annotations

import types

import torch

from megatron_jetrl.patching import require_megatron_core

TARGET_VERSION = "0.16.1"


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """`main_grad += grad_output^T @ total_input` in one GEMM (2-D operands, as megatron's backward passes them)."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


# Only the FP32 entry: `actor.wgrad_fusion` switches a layer only when its main_grad is FP32 (grad_reduce_in_fp32),
# so megatron never calls the extension's `wgrad_gemm_accum_fp16` through this stand-in.
EXTENSION = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32)


def apply() -> None:
    """Install the stand-in (idempotent; keeps apex's extension if megatron found one)."""
    require_megatron_core("megatron_core_0_16_1_wgrad_fusion", TARGET_VERSION)
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = EXTENSION
        layers._grad_accum_fusion_available = True
