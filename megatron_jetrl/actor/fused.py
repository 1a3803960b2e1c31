"""The actor's BF16 glue on CUDA as one kernel per op and direction: RMSNorm and RoPE as Triton kernels.

megatron-core's fused norm and RoPE need apex or Transformer Engine; without them its local layer runs each as a
chain of torch ops (RMSNorm: cast, square, mean, rsqrt, two multiplies and a cast, and autograd's backward of each;
RoPE: two multiplies, a chunk, a negation, two cats). On a Qwen3-8B layer that glue costs about as much time as
the FP8 GEMMs save (BENCHMARKS.md). `actor.glue_kernels` computes each formula below in
one Triton kernel forward and one backward, reading and writing each tensor once, behind a `torch.autograd.Function`
(host cost: one launch). An earlier version compiled these formulas with Inductor: as fast on the GPU, but Dynamo's
and AOTAutograd's per-call host work left a 4096-token layer waiting on the host.

The formulas are the ones the eager path runs, so CPU numerics are untouched: CPU tensors take the functions
eagerly. On CUDA the kernels keep the formulas' own roundings and differ from eager only where a sum runs in another
order or a multiply-add is contracted: a last bit in a small fraction of the elements (tests/gpu/test_fused.py).
RMSNorm rounds the normalized row to BF16 before the weight multiplies it, as HF does; torch's `F.rms_norm` and vLLM
0.26's kernel round once, at the end, and differ from it in about a quarter of the elements (tools/gpu/diag_vllm_layers.py,
BENCHMARKS.md). RoPE computes in FP32 and rounds once, on CUDA and CPU alike.

`on_cuda_compiled` (Inductor, for `actor.logprobs`' row functions, called once per micro-batch, not per layer) raises
Dynamo's recompile limit around its calls only: a function compiles one graph per input rank and stride pattern.
"""

from __future__ import annotations

import functools

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen2/Qwen3/Llama RMSNorm over the last dimension: FP32 statistics, `weight * normalized.to(x.dtype)`."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as megatron's unfused `_apply_rotary_pos_emb_bshd` and HF compute it, in FP32:
    t `[s, b, heads, d]`, cos/sin FP32 `[s, 1, 1, d]` -> `t.dtype`. For FP32 `t` these are megatron's ops to the bit."""
    t32 = t.float()
    x1, x2 = torch.chunk(t32, 2, dim=-1)
    return ((t32 * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).to(t.dtype)


def on_cuda_compiled(fn):
    """`fn` compiled by Inductor (shapes dynamic, one graph) for CUDA tensors; eager for anything else."""
    compiled = torch._dynamo.config.patch(recompile_limit=64)(
        torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
    )

    @functools.wraps(fn)
    def run(x, *args):
        if not x.is_cuda:
            return fn(x, *args)
        try:
            return compiled(x, *args)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # e.g. no C compiler or Triton on this node
            raise RuntimeError(
                f"torch.compile could not build the fused {fn.__name__} kernel ({type(e.inner_exception).__name__}: "
                f"{e.inner_exception}); run with model.fused=false (ActorOptions(fused=False)) for megatron's "
                "eager ops, or fix the Inductor/Triton install"
            ) from e

    return run


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm`; on CUDA one Triton kernel per direction (`actor.glue_kernels.RMSNorm`)."""
    if not x.is_cuda:
        return rms_norm(x, weight, eps)
    from megatron_jetrl.actor.glue_kernels import RMSNorm

    return RMSNorm.apply(x, weight, eps)


def _kernel_tables(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the RoPE kernel takes `t` `[s, b, heads, d]` on CUDA with these tables: megatron's, contiguous FP32
    `[rows, 1, 1, d]`, d even."""
    return (
        t.is_cuda
        and t.dim() == 4
        and t.shape[-1] % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape
        and cos.shape[1:] == (1, 1, t.shape[-1])
    )


def fused_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope`; on CUDA one Triton kernel per direction (`actor.glue_kernels.RoPE`) for megatron's tables: contiguous
    FP32 cos/sin `[s, 1, 1, d]` of the tensor's own length and head dim (anything else runs the eager formula)."""
    if not (_kernel_tables(t, cos, sin) and cos.shape[0] == t.shape[0]):
        return rope(t, cos, sin)
    from megatron_jetrl.actor.glue_kernels import RoPE

    return RoPE.apply(t, cos, sin)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Inference: `(rms_norm(x + residual), x + residual)`, the sum rounded to x's dtype before it is normalized; on
    CUDA one kernel writes both (`actor.glue_kernels.add_rms_norm`, the bits of the two steps: tests/gpu)."""
    if not x.is_cuda:
        h = x + residual
        return rms_norm(h, weight, eps), h
    from megatron_jetrl.actor.glue_kernels import add_rms_norm

    return add_rms_norm(x, residual.contiguous(), weight, eps)


def fused_rope_at(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Inference: `rope(t, cos[positions], sin[positions])` for tables `[max_positions, 1, 1, d]`; on CUDA the kernel
    reads the table rows at `positions` itself (`actor.glue_kernels.rope_at`: no gather kernels)."""
    if not (
        _kernel_tables(t, cos, sin) and positions.dim() == 1 and positions.shape[0] == t.shape[0] and positions.is_contiguous()
    ):
        return rope(t, cos[positions], sin[positions])
    from megatron_jetrl.actor.glue_kernels import rope_at

    return rope_at(t, cos, sin, positions)
