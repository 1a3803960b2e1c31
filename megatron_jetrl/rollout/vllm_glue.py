"""The trainer's RMSNorm and RoPE inside vLLM 0.26, through vLLM's own out-of-tree op registry.

Why: measured on an H100 (`tools/diag_vllm_layers.py`, BENCHMARKS.md "Train/rollout mismatch at hidden 2048"), vLLM's
layer-0 modules differ from the trainer's functions on one input each:
- RMSNorm: 25% of outputs. vLLM rounds once, at the end; the trainer (the HF formula) rounds the normalized row to BF16
  before the weight multiplies it. vLLM's reference for the residual-fused variant (`vllm/ir/ops/layernorm.py`)
  also normalizes the FP32 sum, where the trainer normalizes the BF16-rounded residual.
- RoPE: 18-24% of outputs. vLLM uses BF16 cos/sin and BF16 math; the trainer uses megatron's FP32 tables and FP32 math.
SiLU-and-mul matched exactly. Each differing BF16 value before a quantizer can move a whole E4M3 step, so at hidden
2048 jetrl with vLLM measured 1.6x the mismatch of the native engine.

`register()` makes vLLM build `TrainerRMSNorm` / `TrainerRotaryEmbedding` wherever a model asks for `RMSNorm` /
`RotaryEmbedding` (`CustomOp.register_oot`, read in vllm 0.26.0's `model_executor/custom_op.py`). They run `norm` and
`rope` below: `actor.fused`, the trainer's own Triton kernels on CUDA. They must be registered before the engine builds
its model. For engines without torch.compile only (eager, or full decode CUDA graphs without compilation, the
default): the kernels sit behind autograd Functions that Dynamo does not trace.

`VllmEngine(glue="trainer")` (`rollout.glue: auto` or `trainer`) registers them and `probe` checks at start-up that the model's
layer-0 modules now return the trainer's bytes. `norm` and `rope` are tested on the CPU against the trainer's
functions (tests/unit/test_rollout_vllm_glue.py); `tools/diag_vllm_layers.py --glue trainer` measures the effect.
"""

from __future__ import annotations

import torch

from megatron_jetrl.actor.fused import fused_add_rms_norm, fused_rms_norm, fused_rope, fused_rope_at


def norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """vLLM's RMSNorm contract with the trainer's numerics: `norm(x)`, or with a residual
    `(norm(x + residual), x + residual)`. The sum is the trainer's BF16 residual add, and its rounded value is what
    gets normalized (on CUDA the add is inside the norm's kernel)."""
    if residual is None:
        return fused_rms_norm(x, weight, eps)
    return fused_add_rms_norm(x, residual, weight, eps)


def rope_tables(head_size: int, base: float, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's FP32 cos/sin `[max_positions, 1, 1, head_size]` (`actor.fp8_layers.rope_cos_sin`, rotary_percent 1,
    no scaling). A module keeps its own reference: a captured CUDA graph reads them by address, after the
    trainer's calls may have evicted them from `rope_cos_sin`'s cache."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    return rope_cos_sin(head_size, (("rotary_base", float(base)), ("rotary_percent", 1.0)), max_positions, torch.device(device))


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
    """vLLM's rotary contract (`query` `[tokens, heads * head_size]` at `positions`) with the trainer's RoPE: the
    tables of `rope_tables` and the math of `actor.fused.rope`, the table rows read at `positions` inside the kernel
    on CUDA. Returns new tensors shaped as the inputs."""
    head_size = cos.shape[-1]
    pos = positions.flatten()
    t = pos.shape[0]
    q = fused_rope_at(query.reshape(t, 1, -1, head_size), cos, sin, pos).view_as(query)
    return q, None if key is None else fused_rope_at(key.reshape(t, 1, -1, head_size), cos, sin, pos).view_as(key)


def probe(layer, arch, device, tokens: int = 512, method: str | None = None) -> dict[str, float]:
    """Share of output elements in which a vLLM decoder layer's `input_layernorm` (alone, and with a residual: the
    normalized sum and the sum) and `rotary_emb` differ from the trainer's functions, on one random input each:
    through whatever forward they dispatch to, or through `method` (e.g. `forward_native`)."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin, rope_key

    g = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn(tokens, arch.hidden_size, device=device, generator=g) * 3).to(torch.bfloat16)
    ln, rot, d = layer.input_layernorm, layer.self_attn.rotary_emb, arch.head_dim
    norm_fn, rot_fn = (ln, rot) if method is None else (getattr(ln, method), getattr(rot, method))
    shares = {"rms_norm": (norm_fn(x.clone()) != fused_rms_norm(x, ln.weight, arch.rms_norm_eps)).float().mean().item()}
    r = (torch.randn(tokens, arch.hidden_size, device=device, generator=g) * 3).to(torch.bfloat16)
    y, h = norm_fn(x.clone(), r.clone())  # (clones: vLLM's fused add + norm writes its inputs in place)
    shares["rms_norm_residual"] = torch.cat([(y != fused_rms_norm(x + r, ln.weight, arch.rms_norm_eps)).flatten(),
                                             (h != x + r).flatten()]).float().mean().item()
    q = torch.randn(tokens, arch.num_heads * d, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(tokens, arch.num_kv_heads * d, device=device, generator=g).to(torch.bfloat16)
    got_q, got_k = rot_fn(torch.arange(tokens, device=device), q.clone(), k.clone())
    cos, sin = rope_cos_sin(d, rope_key(arch), tokens, q.device)
    want = [fused_rope(t.view(tokens, 1, -1, d), cos, sin).view(tokens, -1) for t in (q, k)]
    shares["rope"] = torch.cat([(got_q.reshape(tokens, -1) != want[0]).flatten(),
                                (got_k.reshape(tokens, -1) != want[1]).flatten()]).float().mean().item()
    return shares


def registered() -> bool:  # pragma: no cover - needs vLLM
    """Whether this process registered the trainer's classes (vLLM's registry is global: every later engine gets them)."""
    from vllm.model_executor.custom_op import op_registry_oot

    return getattr(op_registry_oot.get("RMSNorm"), "__name__", None) == "TrainerRMSNorm"


def register() -> None:  # pragma: no cover - needs vLLM (tools/diag_vllm_layers.py --glue trainer)
    """Register the two classes in vLLM's out-of-tree registry. Call it once, after the environment is pinned and
    before any engine is built."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if "RMSNorm" in op_registry_oot:
        return

    @CustomOp.register_oot(name="RMSNorm")
    class TrainerRMSNorm(RMSNorm):
        def forward_cuda(self, x, residual=None):
            return norm(x, residual, self.weight, self.variance_epsilon)

        forward_native = forward_cuda

    @CustomOp.register_oot(name="RotaryEmbedding")
    class TrainerRotaryEmbedding(RotaryEmbedding):
        def forward_cuda(self, positions, query, key=None):
            if self.rotary_dim != self.head_size or not self.is_neox_style:
                raise NotImplementedError(f"the trainer's RoPE rotates whole heads, rotate-half style; this model has "
                                          f"rotary_dim {self.rotary_dim} of {self.head_size}, neox {self.is_neox_style}")
            tables = getattr(self, "_trainer_tables", None)
            if tables is None or tables[0].device != query.device:  # made in vLLM's warm-up, before graph capture
                tables = self._trainer_tables = rope_tables(self.head_size, self.base, self.max_position_embeddings,
                                                            query.device)
            return rope(positions, query, key, *tables)

        forward_native = forward_cuda
