"""The rollout engine's own kernels in the actor's forward (`precision.exact_logprobs`, vLLM 0.26.0 on CUDA).

Train/rollout mismatch is exactly 0 only if every op between the token ids and a sampled token's logprob computes
the same bytes in the actor (teacher-forced over whole sequences, micro-batch after micro-batch) as in the engine
(prefill, then one token per decode step, in batches the scheduler picks). Per op, in a Qwen2/Qwen3/Llama layer:

- embedding, residual adds, the SwiGLU product: elementwise, the same on both sides;
- RMSNorm and RoPE: the trainer's kernels run inside vLLM (`rollout.glue`, checked at start-up);
- FP8 linears: one activation quantizer (ours is vLLM's op byte for byte) and DeepGEMM's 1D2D GEMM, whose rows do not
  depend on how many rows a call has (checked on an H100 at M = 1 ... 8192, all four Qwen3-8B linear shapes);
- attention: the actor's torch SDPA differs from vLLM's FlashAttention 3 in a third of its outputs. FA3 with one
  KV split gives every query the same bytes as a causal prefill over the whole sequence, a chunked prefill from the
  paged cache and a paged decode step, so the actor calls FA3 itself (`FA3Attention`: vLLM's build,
  `vllm.vllm_flash_attn`) and vLLM runs with one split (its batch-invariant mode). The backward is flash attention's
  gradient kernel fed FA3's output and log-sum-exp (no forward recomputed): a correct gradient; only the forward must
  match;
- attention over an FP8 KV cache (`PrecisionFlow.kv_cache: fp8`): vLLM quantizes Q with `scaled_fp8_quant` (x times
  the scale's reciprocal) and K/V with its cache write (x divided by the scale), one scale per layer and tensor,
  saturated at +-448. The actor calls those very ops (`fp8_qkv`): a torch restatement of them matched their bytes on
  random tensors, yet GRPO runs with it at scales other than 1 lost exactness in a few tokens. It then runs FA3's FP8
  forward with the same scales as descales. Its bytes do not depend on a
  contiguous or a paged K/V, on chunking or on the batch, but FA3 picks a one-warpgroup kernel when the launch's
  `max_seqlen_q * heads / kv_heads <= 64` (a decode batch), whose FP8 bytes differ from the two-warpgroup kernel of a
  prefill in about 1 output in 12 (H200, Qwen3-8B heads). Both sides therefore launch with `max_seqlen_q` at least
  `fp8_attention_min_q` (patches/vllm_0_26_0_fp8_attention_tile.py in vLLM); what that costs FP8 decode is
  measured in BENCHMARKS.md (FP8 KV cache). `FA3Attention(kv_fp8=True)` holds the layer's scales (`kv_scale`, set by the trainer and shipped at
  sync) and the amax its forwards saw (`kv_amax`, the next scales' input: `rl.kv_scales`);
- lm_head: cuBLAS picks its kernel by the number of rows, and promises nothing about them. Both sides call
  DeepGEMM's BF16 GEMM (`lm_head_gemm`): no split-K on Hopper, so a row's bytes do not depend on the rows beside it
  (checked at M = 1 ... 8192, tools/bench/bench_exact.py), at cuBLAS's speed; vLLM's lm_head runs it through the
  trainer's glue (`rollout.vllm_glue.use_trainer_lm_head`). In mode `bf16` every other linear is BF16 too: both
  sides call vLLM's batch-invariant persistent GEMM (`linear_batch_invariant`, what vLLM's linears run in its
  batch-invariant mode);
- log-softmax: vLLM 0.26's model runner (V2, the default for dense models; pinned by `VLLM_USE_V2_MODEL_RUNNER=1`)
  computes a sampled token's raw logprob with its own Triton kernel on the BF16 logits (`compute_token_logprobs`,
  one program per row); the actor calls that very function (`actor.logprobs.exact_logprobs`, beside the other
  log-softmax paths). The batch-invariant `log_softmax` of
  the V1 runner reads FP32 logits and differs from it in the last bit of about 2% of the logprobs (H100).

The backward of that log-softmax reuses the forward's row log-sum-exp (x_target - logprob) in the default path's
compiled gradient kernel (`actor.logprobs`): one pass over the BF16 logits.

Everything here imports vLLM lazily: build the actor after `rollout.vllm_engine.pin_environment` (vLLM reads its
environment once, at import).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_jetrl.actor.fp8_layers import (
    CausalCoreAttention,
    _column_parallel_input,
    rope_cos_sin,
    rope_key,
    row_parallel_in_rank_order,
)
from megatron_jetrl.actor.fused import fused_rope
from megatron_jetrl.actor.output_layer import GemmLinear

FA_VERSION = 3
"""The FlashAttention build vLLM 0.26 runs on Hopper (`vllm.vllm_flash_attn`, fa_version 3)."""


def _batch_invariant():
    from vllm.model_executor.layers import batch_invariant

    return batch_invariant


E4M3_MAX = 448.0
FP8_ONE_WARPGROUP_ROWS = 64
"""FA3 (vLLM's build) runs a launch on one MMA warpgroup when `max_seqlen_q * heads / kv_heads` is at most this."""


def fp8_attention_min_q(heads: int, kv_heads: int) -> int:
    """The least `max_seqlen_q` at which FA3's FP8 forward runs its two-warpgroup kernel for this head ratio: both sides
    launch with at least this many (module docstring)."""
    return FP8_ONE_WARPGROUP_ROWS // (heads // kv_heads) + 1


def fp8_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor):
    """`[b, s, heads or groups, d]` q, k, v -> their E4M3 bytes as vLLM writes them with per-tensor `scales` `[q, k, v]`:
    q by its query quantizer (`scaled_fp8_quant`), k and v by its FP8 cache write (`reshape_and_cache_flash`, into a
    cache of one-token blocks in token order)."""
    from vllm import _custom_ops as ops

    b, s, heads, d = q.shape
    n, groups = b * s, k.shape[2]
    q8, _ = ops.scaled_fp8_quant(q.reshape(n, heads * d), scales[0:1])
    k8, v8 = (torch.empty(n, 1, groups, d, dtype=torch.uint8, device=q.device) for _ in range(2))
    slots = torch.arange(n, device=q.device)
    ops.reshape_and_cache_flash(k.reshape(n, groups, d), v.reshape(n, groups, d), k8, v8, slots, "fp8", scales[1:2], scales[2:3])
    return q8.view(b, s, heads, d), *(t.view(torch.float8_e4m3fn).view(b, s, groups, d) for t in (k8, v8))


def _flash_backward(grad, q, k, v, out, lse, scale: float):
    """Flash attention's gradient kernel (torch's FlashAttention 2) at `[b, s, heads, d]`, fed a forward's output and
    varlen log-sum-exp `[heads, b * s]`."""
    b, s, heads, _ = q.shape
    lse = lse.view(heads, b, s).transpose(0, 1).contiguous()  # varlen [heads, tokens] -> batched [b, heads, s]
    none = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, None, None, s, s, 0.0, True, none, none, scale=scale
    )[:3]


def _causal_rows(q, k, v, scale: float, min_q: int = 0, scales: torch.Tensor | None = None):
    """vLLM's FA3 over each row of `[b, s, heads or groups, d]` as one causal sequence, one KV split, launched with
    `max_seqlen_q` at least `min_q`; FP8 inputs descaled by `scales` `[q, k, v]`. -> (out `[b, s, heads, d]`, varlen
    log-sum-exp `[heads, b * s]`)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    b, s, heads, d = q.shape
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
    descale = {}
    if scales is not None:
        descale = {f"{t}_descale": scales[i : i + 1].expand(b, k.shape[2]) for i, t in enumerate("qkv")}
    out, lse = flash_attn_varlen_func(
        q.reshape(b * s, heads, d),
        k.reshape(b * s, -1, d),
        v.reshape(b * s, -1, d),
        max_seqlen_q=max(s, min_q),
        cu_seqlens_q=cu,
        max_seqlen_k=s,
        cu_seqlens_k=cu,
        softmax_scale=scale,
        causal=True,
        fa_version=FA_VERSION,
        num_splits=1,
        return_softmax_lse=True,
        **descale,
    )
    return out.view(b, s, heads, d), lse


class _FA3(torch.autograd.Function):
    """Causal attention `[b, s, heads, d]` (k/v with fewer heads: GQA): forward FA3 over each row as one sequence,
    backward flash attention's gradient kernel (torch's FlashAttention 2) fed FA3's own output and log-sum-exp, so
    nothing is recomputed: the gradient of the very function the forward computed."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        out, lse = _causal_rows(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_flash_backward(grad, q, k, v, out, lse, ctx.scale), None)


def fa3_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`[b, s, heads, d]` causal attention with vLLM's FA3 kernel, one KV split (differentiable)."""
    return _FA3.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale)


class _FA3FP8(torch.autograd.Function):
    """FA3's FP8 forward on `fp8_qkv`'s bytes of q, k and v with `scales = [q, k, v]` as descales, launched as vLLM
    launches it (one split, `fp8_attention_min_q`); backward flash attention's BF16 gradient at the dequantized
    inputs, fed the FP8 forward's output and log-sum-exp, passed straight through the quantizers (a saturated element
    gets the gradient of its clamped value)."""

    @staticmethod
    def forward(ctx, q, k, v, scales, scale: float):
        q8, k8, v8 = fp8_qkv(q, k, v, scales)
        heads, groups = q.shape[2], k.shape[2]
        out, lse = _causal_rows(q8, k8, v8, scale, fp8_attention_min_q(heads, groups), scales)
        ctx.save_for_backward(q8, k8, v8, scales, out, lse)
        ctx.scale, ctx.dtype = scale, q.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        q8, k8, v8, scales, out, lse = ctx.saved_tensors
        q, k, v = ((t.float() * scales[i]).to(ctx.dtype) for i, t in enumerate((q8, k8, v8)))
        return (*_flash_backward(grad, q, k, v, out, lse, ctx.scale), None, None)


def fa3_fp8_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor, scale: float
) -> torch.Tensor:
    """`[b, s, heads, d]` causal attention as vLLM computes it over an FP8 KV cache with per-tensor `scales`
    `[q, k, v]` (FP32, on the device): the same bytes (module docstring), differentiable."""
    return _FA3FP8.apply(q.contiguous(), k.contiguous(), v.contiguous(), scales, scale)


class FA3Attention(CausalCoreAttention):
    """Core attention of the local spec under `precision.exact_logprobs`: the trainer's RoPE (the one vLLM runs through
    `rollout.glue`), then vLLM's FA3 with vLLM's softmax scale 1/sqrt(head_dim). Right-padded rows: each row is one
    causal sequence of the micro-batch's length, so a token never sees the padding after it. Megatron layout in and
    out, as `SDPAttention`."""

    def __init__(self, *args, kv_fp8: bool = False, **kwargs):
        super().__init__(*args, **kwargs)  # softmax at 1/sqrt(head_dim), as vLLM's Qwen2/Qwen3/Llama attention scales
        self.kv_fp8 = kv_fp8
        if kv_fp8:  # not in the state dict: the run records the scales (`rl.kv_scales`)
            self.register_buffer("kv_scale", torch.ones(3), persistent=False)
            self.register_buffer("kv_amax", torch.zeros(3), persistent=False)
        self.scale = self.head_dim**-0.5
        self.rope_kwargs = rope_key(self.arch)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("FA3Attention takes unpacked causal sequences without an explicit mask or bias")
        s, b = query.shape[:2]
        cos, sin = rope_cos_sin(self.head_dim, self.rope_kwargs, s, query.device)
        query, key = fused_rope(query, cos, sin), fused_rope(key, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [b, s, heads or groups, d]
        if not self.kv_fp8:
            return fa3_causal_attention(q, k, v, self.scale).transpose(0, 1).reshape(s, b, -1)
        with torch.no_grad():
            seen = torch.stack(
                [torch.linalg.vector_norm(t.detach(), float("inf")).float() for t in (q, k, v)]
            )  # max |x|, one pass
            torch.maximum(self.kv_amax, seen, out=self.kv_amax)
        return fa3_fp8_causal_attention(q, k, v, self.kv_scale, self.scale).transpose(0, 1).reshape(s, b, -1)


def lm_head_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x[M, K] @ weight[N, K].T` in BF16 with DeepGEMM's `bf16_gemm_nt` (batch-invariant: module docstring), the
    lm_head GEMM of both the actor and vLLM under `exact_logprobs`."""
    from megatron_jetrl.fp8.backends import deep_gemm_module

    dg = deep_gemm_module()
    if dg is None or not hasattr(dg, "bf16_gemm_nt"):
        raise RuntimeError(
            "precision.exact_logprobs computes the lm_head with DeepGEMM's bf16_gemm_nt, which this "
            "process cannot import (vLLM 0.26's vllm.third_party.deep_gemm): install the vLLM kit"
        )
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    dg.bf16_gemm_nt(x.contiguous(), weight.contiguous(), y)
    return y


def persistent_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's batch-invariant persistent GEMM `x @ weight.T` (its linears' GEMM in batch-invariant mode)."""
    return _batch_invariant().linear_batch_invariant(x, weight)


def rollout_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemm=persistent_gemm, fuse=False, token_major=False
) -> torch.Tensor:
    """A linear as vLLM computes it under `exact_logprobs`: `gemm`, then `+ bias` in the output dtype (`fuse`,
    `token_major`: `actor.output_layer.GemmLinear`)."""
    y = GemmLinear.apply(x, weight, gemm, fuse, token_major)
    return y if bias is None else y + bias


class RolloutColumnParallelLinear(ColumnParallelLinear):
    """megatron `ColumnParallelLinear` (TP semantics unchanged) whose GEMM is vLLM's batch-invariant one: mode bf16's
    column-parallel linears."""

    gemm = staticmethod(persistent_gemm)
    token_major = False
    takes_wgrad_fusion = True  # `actor.wgrad_fusion` may switch its gradient_accumulation_fusion on (`GemmLinear`'s fuse)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **_):
        x = _column_parallel_input(self, input, allreduce_dgrad, sequence_parallel)
        return rollout_linear(x, weight, bias, self.gemm, gradient_accumulation_fusion, self.token_major)


class RolloutOutputLayer(RolloutColumnParallelLinear):
    """The GPTModel output layer (lm_head) with the lm_head GEMM both sides run (`lm_head_gemm`), its logits
    token-major (`actor.output_layer`)."""

    gemm = staticmethod(lm_head_gemm)
    token_major = True


class RolloutRowParallelLinear(RowParallelLinear):
    """megatron `RowParallelLinear` (megatron all-reduces the output) with vLLM's batch-invariant GEMM."""

    ordered_reduce = False
    """Sum the TP ranks' outputs in rank order (`fp8_layers.use_ordered_reduce`)."""
    takes_wgrad_fusion = True

    def forward(self, input_):
        return row_parallel_in_rank_order(self, input_) if self.ordered_reduce else super().forward(input_)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion=None, **_):
        fuse = self.gradient_accumulation_fusion if gradient_accumulation_fusion is None else gradient_accumulation_fusion
        return rollout_linear(input, weight, bias, fuse=fuse)
