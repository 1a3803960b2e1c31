"""The Transformer Engine path: Jet-RL quantizers wired into megatron-core 0.16.1's TE layer spec (GPU + TE only).

Written against megatron-core 0.16.1 (`megatron/core/fp8_utils.py`): `get_fp8_context(config)` wraps each
layer in `te.fp8_autocast(fp8_recipe=get_fp8_recipe(config))`. `get_fp8_recipe` builds
`Float8BlockScaling(fp8_format=...)` for `fp8_recipe="blockwise"`, dropping our QParams (power-of-two
scales, eps), so that path cannot carry the flow. For `fp8_recipe="custom"` it calls
`CustomRecipe(qfactory=<callable at config.fp8_quantizer_factory>)`, the callable named by a Python import
path string. The two factories below are those callables, built by `megatron_jetrl.fp8.te.quantizer_factory`
from a `PrecisionFlow` (one per scale mode: the factory only reads `scale_mode` and `eps`).

Numerics caveat (see `megatron_jetrl.fp8.te`): TE quantizes with `x * (448 / amax)`; only with
`scale_mode="ue8m0"` are its bytes the rollout's. With `fp32` scales use the native spec.
Not runnable here (no TE on these machines): `te_config_kwargs` and the factory selection are tested.
"""

from __future__ import annotations

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8.te import quantizer_factory

jetrl_fp32_qfactory = quantizer_factory(PrecisionFlow(mode="jetrl", scale_mode="fp32"))
jetrl_ue8m0_qfactory = quantizer_factory(PrecisionFlow(mode="jetrl", scale_mode="ue8m0"))

_FACTORIES = {"fp32": "jetrl_fp32_qfactory", "ue8m0": "jetrl_ue8m0_qfactory"}


def te_config_kwargs(flow: PrecisionFlow) -> dict:
    """TransformerConfig fields that make megatron's TE layers run the flow's FP8 (empty in BF16 training)."""
    if not flow.train_fp8:
        return {}
    if flow.eps != PrecisionFlow().eps:
        raise ValueError(f"the TE path's quantizer factories use eps={PrecisionFlow().eps}; got eps={flow.eps}")
    return {"fp8": "e4m3", "fp8_recipe": "custom", "fp8_quantizer_factory": f"{__name__}.{_FACTORIES[flow.scale_mode]}"}


def te_layer_spec(qk_norm: bool):
    """megatron's TE GPT layer spec (TE fused LayerNorm+Linear; norms named `linear_qkv.layer_norm_weight`).

    With `normalization="RMSNorm"` in the config, TE builds RMSNorm. Use `models.mapping.model_entries(..., spec="te")`.
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        raise RuntimeError("the TE layer spec needs Transformer Engine; use spec='native' (runs anywhere, bit-exact)")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
