"""Transformer Engine recipes built from a `PrecisionFlow` (optional; TE is imported lazily).

Read against TransformerEngine 2.20.2 (`transformer_engine/common/recipe/__init__.py`,
`common/recipe/recipe_common.cuh`) and Megatron-core 0.16's `get_fp8_recipe`:

* `Float8BlockScaling` computes its QParams (`power_2_scale`, `amax_epsilon`) as *class attributes* from
  `NVTE_FP8_BLOCK_SCALING_FP32_SCALES` when TE is first imported; they are not constructor fields.
  We therefore set them on the instance (and export the env var too, for TE code that reads it).
  Megatron's `--fp8-recipe blockwise` passes only `fp8_format`, so use this builder instead.
* TE quantizes with `scale = 448 / amax` (`__fdiv_rn`) and `q = x * scale`; power-of-two mode truncates
  the mantissa of that scale. With power-of-two scales (`scale_mode="ue8m0"`) both products are exact,
  so TE's bytes equal the reference quantizer's (except when `448 / amax` rounds onto a power of two in
  FP32, i.e. amax within an ulp of 448 * 2**k). With FP32 scales `x * (448 / amax)` and
  `x / (amax / 448)` differ in the last bit now and then, so TE's FP8 bytes differ from what a vLLM
  rollout computes: the TE path is the on-policy Jet-RL flow only with `ue8m0` scales; with `fp32` use
  the native path (megatron_jetrl.fp8.linear), which is bit-exact by construction.
* `CustomRecipe(qfactory=...)` exists from TE 2.9; its factory got `QuantizerRole(module_type,
  tensor_type, name)` instead of a role string ("linear_input", ...) in later versions: both are handled.
"""

from __future__ import annotations

import os

from megatron_jetrl.fp8.flow import PrecisionFlow

QUANTIZED_ROLES = {"input": 1, "weight": 2, "grad_output": 1}  # tensor -> block scaling dim (1: 1x128, 2: 128x128)


def _require_fp8_training(flow: PrecisionFlow) -> None:
    if not flow.train_fp8:
        raise ValueError(f"mode={flow.mode!r} trains in BF16: no Transformer Engine FP8 recipe applies (use mode='jetrl')")


def te_qparams_kwargs(flow: PrecisionFlow) -> dict:
    """Keyword arguments of TE's `QParams` for activations, weights and gradients alike."""
    return {"power_2_scale": flow.scale_mode == "ue8m0", "amax_epsilon": flow.eps}


def block_scaling_recipe(flow: PrecisionFlow, recipe_module=None):
    """A TE `Float8BlockScaling` matching the flow: E4M3 everywhere, 1D inputs/grads, 2D weights."""
    _require_fp8_training(flow)
    os.environ.update(flow.te_env())
    if recipe_module is None:
        import transformer_engine.common.recipe as recipe_module
    recipe = recipe_module.Float8BlockScaling(
        fp8_format=recipe_module.Format.E4M3, x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1
    )
    qparams = recipe_module.QParams(**te_qparams_kwargs(flow))
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = qparams
    return recipe


def role_tensor_type(role) -> str | None:
    """'input' / 'weight' / 'grad_output' for the linear roles we quantize, None for any other role.

    Accepts the old string roles ("linear_input") and the newer `QuantizerRole` objects.
    """
    if role is None:
        return None
    if isinstance(role, str):
        module_type, _, tensor_type = role.partition("_")
        if module_type == "grouped":
            module_type, _, tensor_type = tensor_type.partition("_")
    else:
        module_type, tensor_type = getattr(role, "module_type", ""), getattr(role, "tensor_type", "")
    if module_type not in ("linear", "grouped_linear") or tensor_type not in QUANTIZED_ROLES:
        return None
    return tensor_type


def quantizer_factory(flow: PrecisionFlow):
    """A `CustomRecipe` quantizer factory that builds TE's blockwise quantizers from the flow."""
    _require_fp8_training(flow)

    def factory(role):
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

        tensor_type = role_tensor_type(role)
        if tensor_type is None:
            if isinstance(role, str) or role is None:
                return None
            from transformer_engine.pytorch.quantization import IdentityQuantizer  # newer TE wants an object

            return IdentityQuantizer()
        return Float8BlockQuantizer(
            fp8_dtype=tex.DType.kFloat8E4M3,
            rowwise=True,
            columnwise=True,
            amax_epsilon=flow.eps,
            force_pow_2_scales=flow.scale_mode == "ue8m0",
            block_scaling_dim=QUANTIZED_ROLES[tensor_type],
        )

    return factory


def custom_recipe(flow: PrecisionFlow, recipe_module=None):
    """TE >= 2.9 `CustomRecipe` whose quantizers come from `quantizer_factory(flow)`."""
    if recipe_module is None:
        import transformer_engine.common.recipe as recipe_module
    if not hasattr(recipe_module, "CustomRecipe"):
        raise RuntimeError("this Transformer Engine has no CustomRecipe (added in TE 2.9); use block_scaling_recipe(flow)")
    return recipe_module.CustomRecipe(qfactory=quantizer_factory(flow), fp8_format=recipe_module.Format.E4M3)
