"""PrecisionFlow validation and the settings it derives for vLLM, Transformer Engine and checkpoints."""

import glob
import importlib.util
import os
import sys
import zipfile
from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import pytest

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8 import te as te_mod


def test_modes_derive_gemms_and_rollout():
    assert PrecisionFlow(mode="jetrl").gemms == ("fprop", "dgrad", "wgrad")
    foil = PrecisionFlow(mode="bf16-train-fp8-rollout")
    assert foil.gemms == () and foil.rollout_fp8 and not foil.same_forward
    base = PrecisionFlow(mode="bf16")
    assert not base.train_fp8 and not base.rollout_fp8 and base.same_forward
    assert PrecisionFlow().same_forward


def test_checkpoint_quantization_config():
    assert PrecisionFlow().quantization_config() == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert PrecisionFlow(scale_mode="ue8m0").quantization_config()["scale_fmt"] == "ue8m0"
    assert PrecisionFlow(mode="bf16").quantization_config() is None


def test_vllm_env_stops_requantization_unless_scales_are_already_powers_of_two():
    assert PrecisionFlow().vllm_env() == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert PrecisionFlow(mode="bf16-train-fp8-rollout", scale_mode="ue8m0").vllm_env() == {"VLLM_USE_DEEP_GEMM_E8M0": "1"}
    assert PrecisionFlow(mode="bf16").vllm_env() == {}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mode="fp8"), "mode must be one of"),
        (dict(fmt="e5m2"), "use fmt='e4m3'"),
        (dict(act_group=64), "act_group must be 128"),
        (dict(weight_block=(64, 64)), "weight_block must be"),
        (dict(scale_mode="mxfp8"), "scale_mode must be"),
        (dict(mode="bf16", scale_mode="ue8m0"), "has no effect in mode='bf16'"),
        (dict(eps=0.0), "eps must be"),
        (dict(eps=1), "eps must be"),
        (dict(backend="cutlass"), "backend must be"),
        (dict(gemm_sms=-8), "gemm_sms must be a whole number"),
        (dict(gemm_sms=True), "gemm_sms must be a whole number"),
        (dict(gemm_sms=120.0), "gemm_sms must be a whole number"),
        (dict(gemm_sms=120, backend="cublaslt"), "never runs them"),
    ],
)
def test_contradictory_or_unknown_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionFlow(**kwargs)


def test_frozen_and_dict_round_trip():
    flow = PrecisionFlow(scale_mode="ue8m0", weight_block=[128, 128])
    assert flow.weight_block == (128, 128)
    with pytest.raises(FrozenInstanceError):
        flow.mode = "bf16"
    assert PrecisionFlow.from_dict(flow.to_dict()) == flow
    with pytest.raises(ValueError, match="unknown PrecisionFlow keys"):
        PrecisionFlow.from_dict({"mode": "jetrl", "scale": "fp32"})


def load_te_recipe_module():
    """TE's recipe module from the pure `transformer-engine` wheel (plain dataclasses, no TE core library)."""
    wheels = glob.glob(os.path.join(os.environ.get("JETRL_WHEEL_CACHE", ".cache/wheels"), "transformer_engine-*.whl"))
    if not wheels or importlib.util.find_spec("pydantic") is None:
        pytest.skip("transformer_engine wheel or pydantic missing: run tools/test.sh, which fetches them")
    source = zipfile.ZipFile(sorted(wheels)[-1]).read("transformer_engine/common/recipe/__init__.py")
    spec = importlib.util.spec_from_loader("transformer_engine.common.recipe", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source, "transformer_engine/common/recipe/__init__.py", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("scale_mode", ["fp32", "ue8m0"])
def test_real_te_float8_block_scaling_from_flow(scale_mode, monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    recipe_module = load_te_recipe_module()
    flow = PrecisionFlow(scale_mode=scale_mode)
    recipe = te_mod.block_scaling_recipe(flow, recipe_module)
    assert isinstance(recipe, recipe_module.Float8BlockScaling)
    assert recipe.fp8_format == recipe_module.Format.E4M3
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) == (1, 2, 1)
    for q in (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad):
        assert q.power_2_scale == (scale_mode == "ue8m0") and q.amax_epsilon == flow.eps
    # the class defaults were fixed at import from the env, which is why the builder sets the instance
    assert recipe_module.Float8BlockScaling.fp8_quant_fwd_inp.power_2_scale is True
    assert os.environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == ("1" if scale_mode == "fp32" else "0")
    with pytest.raises(ValueError, match="trains in BF16"):
        te_mod.block_scaling_recipe(PrecisionFlow(mode="bf16-train-fp8-rollout"), recipe_module)


def test_te_custom_recipe_roles_old_and_new():
    assert te_mod.role_tensor_type("linear_input") == "input"
    assert te_mod.role_tensor_type("linear_grad_output") == "grad_output"
    assert te_mod.role_tensor_type("linear_output") is None
    assert te_mod.role_tensor_type(SimpleNamespace(module_type="linear", tensor_type="weight", name="fc1")) == "weight"
    assert te_mod.role_tensor_type(SimpleNamespace(module_type="grouped_linear", tensor_type="input", name="")) == "input"
    assert te_mod.role_tensor_type(SimpleNamespace(module_type="dpa", tensor_type="input", name="")) is None
    assert te_mod.role_tensor_type(None) is None
    recipe_module = load_te_recipe_module()
    recipe = te_mod.custom_recipe(PrecisionFlow(), recipe_module)
    assert isinstance(recipe, recipe_module.CustomRecipe) and callable(recipe.qfactory)
