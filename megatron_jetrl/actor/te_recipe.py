"""The TE layer spec: megatron-core 0.16.1's `get_gpt_layer_with_transformer_engine_spec` with the Jet-RL recipe.

`te_config_kwargs(flow)` is the one place where a `PrecisionFlow` becomes TransformerConfig FP8 fields: mode `jetrl`
-> `fp8="e4m3", fp8_recipe="custom", fp8_quantizer_factory=<a factory below>`. megatron's `get_fp8_context` then
wraps every layer in `te.fp8_autocast(fp8_recipe=CustomRecipe(qfactory=<factory>))`; the factory (built by
`fp8.te.quantizer_factory`, one per scale mode since megatron resolves it by import path) hands TE its own
`Float8BlockQuantizer`s with the flow's eps and scale mode. `bf16` and `bf16-train-fp8-rollout` train the TE layers
in BF16 (no FP8 fields). Numerics and the fp32/ue8m0 byte consequences: `megatron_jetrl.fp8.te`.

TE fuses the pre-attention and pre-MLP RMSNorm into `linear_qkv` / `linear_fc1` (TELayerNormColumnParallelLinear):
their weights are `...linear_qkv.layer_norm_weight` / `...linear_fc1.layer_norm_weight`, which
`models.mapping.model_entries(arch, spec="te")` maps to HF's `input_layernorm` / `post_attention_layernorm`.

`te_fp8_weights(model, flow)` is the TE counterpart of `fp8_layers.fp8_weights`: every TE linear's weight
quantized by TE's own 128x128 kernel with the quantizer TE's forward uses -- the bytes and scale_inv the next
forward multiplies by (TE re-quantizes its weight on the first micro-batch of every step; the kernel is
deterministic) -- by megatron parameter name, for `models.export.hf_tensors(..., fetch_fp8=...)`.
TP and PP: megatron's TE wrappers shard like the local linears (column-parallel out-dim, row-parallel in-dim), so a
rank's weight is its shard and the 128-alignment check (`ModelArch.check_fp8_tp`) makes its blocks the full
weight's blocks; the weight stream gathers shards over TP as for the local spec. Needs CUDA + TE: tests/gpu/test_te.py.
"""

from __future__ import annotations

import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8.te import quantizer_factory, require_te

jetrl_fp32_qfactory = quantizer_factory(PrecisionFlow(mode="jetrl", scale_mode="fp32"))
jetrl_ue8m0_qfactory = quantizer_factory(PrecisionFlow(mode="jetrl", scale_mode="ue8m0"))

_FACTORIES = {"fp32": "jetrl_fp32_qfactory", "ue8m0": "jetrl_ue8m0_qfactory"}


def te_config_kwargs(flow: PrecisionFlow) -> dict:
    """TransformerConfig fields that make megatron's TE layers run the flow's FP8 (empty in BF16 training)."""
    if not flow.train_fp8:
        return {}
    if flow.eps != PrecisionFlow().eps:
        raise ValueError(
            f"the TE spec's quantizer factories use eps={PrecisionFlow().eps} (vLLM's); got eps={flow.eps}: "
            "leave precision.eps at its default or use the local spec"
        )
    return {"fp8": "e4m3", "fp8_recipe": "custom", "fp8_quantizer_factory": f"{__name__}.{_FACTORIES[flow.scale_mode]}"}


def te_layer_spec(qk_norm: bool):
    """megatron's TE GPT layer spec (TE fused RMSNorm+Linear for qkv and fc1; TE attention; TE q/k norms)."""
    require_te()
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        raise RuntimeError(
            "megatron-core could not import Transformer Engine (megatron.core.extensions.transformer_engine."
            "HAVE_TE is False) although it is installed: import transformer_engine in this environment to "
            "see why (after `source .kits/te/bin/env.sh` on the GPU machine)"
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)


def te_linears(model) -> dict[str, torch.nn.Module]:
    """Every TE module of the model (under any wrappers) that holds a 2-D `weight`: {module name: module}."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    from megatron_jetrl.actor.gpt import unwrap

    return {
        name: m
        for name, m in unwrap(model).named_modules()
        if isinstance(m, TransformerEngineBaseModule)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
    }


def te_fp8_weights(model, flow: PrecisionFlow) -> dict:
    """This rank's FP8 weights of every TE linear by megatron parameter name (`...linear_qkv.weight`): TE's bytes.

    A weight that is already a TE block tensor (FP8 primary weights) is read as is; otherwise it is quantized by TE's
    kernel with `fp8.te.make_block_quantizer(flow, "weight")`, the quantizer the forward got from the factory.
    """
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    from megatron_jetrl.fp8.te import make_block_quantizer, te_weight

    if not flow.train_fp8:
        raise ValueError(
            f"mode={flow.mode!r} trains the TE layers in BF16: their FP8 export is the flow's quantizer "
            "(models.export.quantize_ranks), not TE's"
        )
    quantizer = make_block_quantizer(flow, "weight", rowwise=True, columnwise=False)
    out = {}
    with torch.no_grad():
        for name, m in te_linears(model).items():
            w = m.weight
            qt = w if isinstance(w, QuantizedTensor) else quantizer(w.detach())
            out[f"{name}.weight"] = te_weight(qt)
    return out
