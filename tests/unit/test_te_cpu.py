"""The Transformer Engine path without CUDA: config refusals, recipe derivation (TE's pure-Python recipe module), TE's
quantizer numerics (`fp8.te.te_quantize`) against the reference quantizer, TE tensor layouts, and the export of TE bytes
through the one mapping table. What needs TE's kernels is in tests/gpu/test_te.py."""

from types import SimpleNamespace

import pytest
import torch
from test_flow import load_te_recipe_module

from megatron_jetrl.fp8 import PrecisionFlow, quantize_blockwise
from megatron_jetrl.fp8 import te as te_mod
from megatron_jetrl.fp8.linear import QuantizedWeight
from megatron_jetrl.models import ModelArch, hf_tensors, model_entries
from megatron_jetrl.models.mapping import to_hf
from megatron_jetrl.rl.config import ConfigError, load_config

BLOCKS = [(1, 128), (128, 1), (128, 128)]
QWEN = {
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 384,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def probe(seed=0, m=512, k=1024):
    """BF16 groups of magnitudes 2**-40 .. 2**20, an all-zero and a tiny (1e-9) tile, exact 448 * 2**j amaxes."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-40, 20, (m, k // 128), generator=g).float()).repeat_interleave(128, 1)
    x = torch.randn(m, k, generator=g) * mag
    if m >= 384 and k >= 256:
        x[:128, :128] = 0
        x[128:256, :128] = torch.randn(128, 128, generator=g) * 1e-9
        x[256:384, 128:256] = torch.randn(128, 128, generator=g).clamp(-1, 1) * 448 * 2.0**-3
        x[300, 200] = 448 * 2.0**-3
    return x.bfloat16()


# ---- config -------------------------------------------------------------------------------------------------


def test_te_spec_refused_without_te_with_the_install_line(monkeypatch):
    monkeypatch.setattr(te_mod, "te_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"model\.spec=te: Transformer Engine 2\.20\.2 is not importable") as e:
        load_config(None, ["model.spec=te"])
    assert te_mod.INSTALL_LINE in str(e.value) and "model.spec=local" in str(e.value)
    with pytest.raises(ConfigError, match="model.spec must be 'local' or 'te'"):
        load_config(None, ["model.spec=native"])
    assert load_config(None, []).model.spec == "local"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.batch_invariant=true"], "set model.batch_invariant=false"),
        (["run.device=cpu"], r"model\.spec=te needs a GPU run"),
        (["precision.eps=1.0e-8"], r"leave precision\.eps at its default"),
        (["precision.gemm_sms=120"], r"leave precision\.gemm_sms at 0 or use model\.spec=local"),
        (
            ["grpo.micro_batch_size=4", "grpo.prompts_per_step=4", "rollout.n=4"],
            r"set grpo\.micro_batch_size and .* multiples of 8 \(got 4 and 4\)",
        ),
        (
            ["grpo.micro_batch_size=8", "grpo.logprob_micro_batch_size=4"],
            r"grpo\.logprob_micro_batch_size to multiples of 8 \(got 8 and 4\)",
        ),
        (["run.device=cuda", "rollout.engine=vllm", "rollout.glue=trainer"], r"model\.spec=te trains with Transformer Engine's"),
    ],
)
def test_te_spec_refuses_what_it_cannot_honour(monkeypatch, overrides, message):
    monkeypatch.setattr(te_mod, "te_installed", lambda: True)
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.spec=te", *overrides])
    cfg = load_config(None, ["model.spec=te", "run.device=cuda", "precision.scale_mode=ue8m0"])
    assert cfg.model.spec == "te" and cfg.to_dict()["model"]["spec"] == "te"


def test_actor_options_spec_names():
    from megatron_jetrl.actor.provider import ActorOptions

    assert ActorOptions().spec == "local" and ActorOptions(spec="native").spec == "local"
    with pytest.raises(ValueError, match="batch_invariant=True needs spec='local'"):
        ActorOptions(spec="te", batch_invariant=True)
    with pytest.raises(ValueError, match="spec must be 'local' or 'te'"):
        ActorOptions(spec="tex")


# ---- recipe derivation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_mode", ["fp32", "ue8m0"])
def test_flow_to_transformer_config_and_quantizer_settings(scale_mode):
    """The one place (te_config_kwargs) and the factory's quantizer settings, read back through megatron's resolver."""
    from megatron.core.fp8_utils import _resolve_callable_from_python_import_path

    from megatron_jetrl.actor import te_recipe

    flow = PrecisionFlow(mode="jetrl", scale_mode=scale_mode)
    kw = te_recipe.te_config_kwargs(flow)
    assert (kw["fp8"], kw["fp8_recipe"]) == ("e4m3", "custom")
    factory = _resolve_callable_from_python_import_path(kw["fp8_quantizer_factory"])
    assert factory is getattr(te_recipe, f"jetrl_{scale_mode}_qfactory")
    for tensor, dim in (("input", 1), ("weight", 2), ("grad_output", 1)):
        assert te_mod.quantizer_kwargs(flow, tensor) == {
            "rowwise": True,
            "columnwise": True,
            "amax_epsilon": 1e-10,
            "force_pow_2_scales": scale_mode == "ue8m0",
            "block_scaling_dim": dim,
        }
    for mode in ("bf16", "bf16-train-fp8-rollout"):
        assert te_recipe.te_config_kwargs(PrecisionFlow(mode=mode)) == {}
    with pytest.raises(ValueError, match="leave precision.eps at its default"):
        te_recipe.te_config_kwargs(PrecisionFlow(eps=1e-8))


def test_factory_roles_of_te_2_20(monkeypatch):
    """TE 2.20 passes QuantizerRole(module_type, tensor_type, name) and role None for output / grad-input slots, and
    refuses a factory that returns None: every non-linear-operand role gets an identity quantizer."""
    made = []
    monkeypatch.setattr(te_mod, "make_block_quantizer", lambda flow, t: made.append((flow.scale_mode, t)) or ("block", t))
    monkeypatch.setattr(te_mod, "_identity_quantizer", lambda: "identity")
    factory = te_mod.quantizer_factory(PrecisionFlow(scale_mode="ue8m0"))
    role = lambda module, tensor: SimpleNamespace(module_type=module, tensor_type=tensor, name="qkv")  # noqa: E731
    assert factory(role("linear", "input")) == ("block", "input")
    assert factory(role("linear", "weight")) == ("block", "weight")
    assert factory(role("grouped_linear", "grad_output")) == ("block", "grad_output")
    assert factory(None) == factory(role("linear", "output")) == factory(role("dpa", "qkv")) == "identity"
    assert made == [("ue8m0", "input"), ("ue8m0", "weight"), ("ue8m0", "grad_output")]
    assert te_mod.role_tensor_type("grouped_linear_weight") == "weight"


def test_custom_recipe_from_te_recipe_module():
    recipe_module = load_te_recipe_module()
    recipe = te_mod.custom_recipe(PrecisionFlow(scale_mode="ue8m0"), recipe_module)
    assert isinstance(recipe, recipe_module.CustomRecipe) and recipe.custom() and not recipe.float8_block_scaling()
    assert recipe_module.CustomRecipe.__dataclass_fields__["quantization_alignment"].default == 128


# ---- TE's numerics vs the reference quantizer ------------------------------------------------------------------


def test_te_scale_rule():
    """compute_scale_from_amax: eps floor, RN(448/amax), power-of-two by cutting the mantissa (rounds the multiplier down)."""
    amax = torch.tensor([0.0, 1e-12, 3.0, 448.0, 448.0 * 2**-5, 1000.0])
    fp32 = te_mod.te_scale(amax, "fp32")
    assert torch.equal(fp32, torch.tensor(448.0) / amax.clamp_min(1e-10))  # a true division, as __fdiv_rn
    pow2 = te_mod.te_scale(amax, "ue8m0")
    assert torch.equal(pow2, torch.exp2(torch.floor(torch.log2(fp32))))
    assert pow2[2] == 128.0 and pow2[3] == 1.0 and pow2[4] == 32.0 and pow2[5] == 0.25


@pytest.mark.parametrize("block", BLOCKS)
def test_ue8m0_te_bytes_equal_reference_except_tiny_groups(block):
    """ue8m0: TE and vLLM agree in every group with max(amax, eps) > 448 * 2**-34; in the others (all-zero groups too)
    exactly the scale differs (vLLM floors s at 1e-10, TE does not), and the bytes with it unless the group is zero."""
    x = probe()
    q_te, s_te = te_mod.te_quantize(x, block, "ue8m0")
    q_ref, s_ref = quantize_blockwise(x, block, "ue8m0")
    d = te_mod.byte_diff(q_te, s_te, q_ref, s_ref, block)
    tiny = te_mod.group_amax(x, block).clamp_min(1e-10) <= te_mod.UE8M0_TE_DIFFERS_AT_OR_BELOW
    assert tiny.any() and (~tiny).any()
    assert torch.equal(d["groups_with_scale_diff"], tiny)
    assert not (d["groups_with_byte_diff"] & ~tiny).any()
    assert (s_te[tiny] < s_ref[tiny]).all() and (s_ref[tiny] == 2.0**-33).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_fp32_te_differs_by_one_e4m3_step_and_one_scale_ulp(block):
    """fp32: TE's x * RN(448/amax) vs vLLM's x / RN(amax/448): scales differ by at most one FP32 ulp and a differing byte
    is always the adjacent E4M3 code of the same sign; both happen (a fraction of the elements, printed)."""
    x = probe(1)
    q_te, s_te = te_mod.te_quantize(x, block, "fp32")
    q_ref, s_ref = quantize_blockwise(x, block, "fp32")
    d = te_mod.byte_diff(q_te, s_te, q_ref, s_ref, block)
    print(f"fp32 {block}: identical bytes {d['bytes_identical']:.6f}, identical scales {d['scales_identical']:.4f}")
    assert d["max_scale_ulps"] == 1 and d["differing_bytes_adjacent"]
    assert 0 < d["differing_bytes"] and d["bytes_identical"] > 0.999
    one, fp8_max = torch.tensor(1.0), torch.tensor(448.0)  # tensor / tensor: true divisions (scalar / tensor is not)
    assert torch.equal(s_te, one / (fp8_max / te_mod.group_amax(x, block).clamp_min(1e-10)))


def test_te_quantize_matches_dequantized_closeness():
    x = probe(2)
    for mode in ("fp32", "ue8m0"):
        q, s = te_mod.te_quantize(x, (128, 128), mode)
        from megatron_jetrl.fp8 import dequantize_blockwise

        err = (dequantize_blockwise(q, s, (128, 128)) - x.float()).abs() / x.float().abs().clamp_min(1e-30)
        big = x.float().abs() > 2**-6 * te_mod.group_amax(x, (128, 128)).repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert err[big].max() <= 2**-4 + 1e-6  # E4M3 keeps 3 mantissa bits in the normal range


# ---- TE tensor layouts ------------------------------------------------------------------------------------------


def _te_like(x: torch.Tensor, dim: int, mode: str = "fp32"):
    """A Float8BlockwiseQTensor-shaped object laid out as TE 2.20.2 lays it out (GEMM-ready, padded scales)."""
    m, k = x.shape
    r4 = lambda n: -(-n // 4) * 4  # noqa: E731
    if dim == 2:
        q, s = te_mod.te_quantize(x, (128, 128), mode)
        rs = torch.full((-(-m // 128), r4(-(-k // 128))), float("nan"))
        rs[:, : s.shape[1]] = s
        cs = torch.full((-(-k // 128), r4(-(-m // 128))), float("nan"))
        cs[:, : s.shape[0]] = s.t()
        cols = q.t().contiguous()
    else:
        q, s = te_mod.te_quantize(x, (1, 128), mode)
        rs = torch.full((-(-k // 128), r4(m)), float("nan"))
        rs[:, :m] = s.t()
        qc, sc = te_mod.te_quantize(x, (128, 1), mode)
        cs = torch.full((-(-m // 128), r4(k)), float("nan"))
        cs[:, :k] = sc
        cols = qc.t().contiguous()
    return SimpleNamespace(
        _rowwise_data=q.view(torch.uint8),
        _rowwise_scale_inv=rs,
        _columnwise_data=cols.view(torch.uint8),
        _columnwise_scale_inv=cs,
        _is_2D_scaled=dim == 2,
    )


@pytest.mark.parametrize("shape", [(256, 384), (130, 250)])
def test_te_layouts_to_ours(shape):
    x = probe(3, 512, 512)[: shape[0], : shape[1]].contiguous()
    w = _te_like(x, 2)
    qw = te_mod.te_weight(w)
    ref = te_mod.te_quantize(x, (128, 128))
    assert torch.equal(qw.q.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(qw.s, ref[1])
    assert torch.equal(te_mod.te_tensor_parts(w)["columnwise"][1], ref[1])
    a = te_mod.te_tensor_parts(_te_like(x, 1))
    for kind, block in (("rowwise", (1, 128)), ("columnwise", (128, 1))):
        q, s = te_mod.te_quantize(x, block)
        assert torch.equal(a[kind][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(a[kind][1], s), kind
    with pytest.raises(ValueError, match="must be a 128x128"):
        te_mod.te_weight(_te_like(x, 1))
    with pytest.raises(ValueError, match="does not hold the 1x128 scales"):
        te_mod.from_te_rowwise(w._rowwise_data, w._rowwise_scale_inv[:1, :1], False)


# ---- export of TE's bytes through the one mapping table ---------------------------------------------------------


def test_te_parameter_names_map_through_the_one_table():
    """TE's fused norms (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) map to the same HF tensors as the
    local spec's norms; every other name is shared (the names megatron 0.16.1's TE spec registers)."""
    arch = ModelArch.from_hf_config(QWEN)
    local, te = model_entries(arch, spec="local"), model_entries(arch, spec="te")
    assert [e.hf for e in local] == [e.hf for e in te]
    renamed = {a.megatron: b.megatron for a, b in zip(local, te) if a.megatron != b.megatron}
    assert renamed == {
        f"decoder.layers.{i}.{a}": f"decoder.layers.{i}.{b}"
        for i in range(2)
        for a, b in (
            ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        )
    }
    layer0 = {e.megatron for e in te if e.megatron.startswith("decoder.layers.0.")}
    assert layer0 == {
        "decoder.layers.0." + n
        for n in (
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        )
    }


@pytest.mark.parametrize("scale_mode", ["fp32", "ue8m0"])
def test_hf_stream_ships_te_bytes_unchanged(scale_mode):
    """`hf_tensors(..., fetch_fp8=<TE's weights>)` with TE naming: every exported byte and scale is TE's (fused q/k/v and
    gate/up cut by the table), and in fp32 they differ from what our quantizer would have shipped."""
    arch = ModelArch.from_hf_config(QWEN)
    flow = PrecisionFlow(mode="jetrl", scale_mode=scale_mode)
    entries = model_entries(arch, spec="te")
    g = torch.Generator().manual_seed(4)
    shapes = {
        "linear_qkv.weight": (512, 256),
        "linear_proj.weight": (256, 256),
        "linear_fc1.weight": (1024, 256),
        "linear_fc2.weight": (256, 512),
    }
    params = {}
    for e in entries:
        shape = next((s for k, s in shapes.items() if e.megatron.endswith(k)), None)
        params[e.megatron] = (
            torch.randn(
                shape or ((384, 256) if "embedding" in e.megatron else (512,) if "bias" in e.megatron else (256,)), generator=g
            )
            * 0.05
        ).bfloat16()
    te_weights = {
        n: te_mod.te_weight(_te_like(p, 2, scale_mode)) for n, p in params.items() if p.dim() == 2 and "embedding" not in n
    }
    out = dict(hf_tensors(arch, flow, entries, lambda n: [params[n]], lambda n: [te_weights[n]]))
    ours = dict(hf_tensors(arch, flow, entries, lambda n: [params[n]]))
    differs = False
    for e in entries:
        if not e.fp8:
            continue
        want_q = to_hf(e, arch, te_weights[e.megatron].q.view(torch.uint8))
        want_s = to_hf(e, arch, te_weights[e.megatron].s, unit=128)
        for name in e.hf:
            assert torch.equal(out[name].view(torch.uint8), want_q[name])
            assert torch.equal(out[name.removesuffix("weight") + "weight_scale_inv"], want_s[name])
            differs |= not torch.equal(out[name].view(torch.uint8), ours[name].view(torch.uint8))
    assert differs == (scale_mode == "fp32")  # ue8m0: TE's bytes are ours (no tiny blocks here)
    assert torch.equal(
        out["model.layers.0.input_layernorm.weight"], params["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    )


def test_converter_uses_te_numerics_for_te_checkpoints():
    from megatron_jetrl.convert.converter import Plan

    w = probe(5, 256, 256)
    jet = PrecisionFlow(mode="jetrl")
    plan = lambda spec, source: Plan(None, None, source, source, "fp8", 1, [], spec)  # noqa: E731
    te_w = plan("te", jet).weight_quantizer()(w, jet)
    want = te_mod.te_quantize(w, (128, 128))
    assert torch.equal(te_w.q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(te_w.s, want[1])
    assert plan("local", jet).weight_quantizer() == QuantizedWeight.quantize
    foil = PrecisionFlow(mode="bf16-train-fp8-rollout")  # the TE layers trained in BF16: the rollout's own quantizer
    assert plan("te", foil).weight_quantizer() == QuantizedWeight.quantize


def test_te_compare_table(tmp_path):
    """tools/bench/te_compare.py: one row per mode and spec, step-0 numbers, step-time ratio; exit 2 without metrics."""
    import json
    import subprocess
    import sys

    for spec, step in (("local", 2.0), ("te", 3.0)):
        d = tmp_path / spec
        d.mkdir()
        rows = [
            {
                "loss/total": 0.5 + i,
                "mismatch/mean_abs_diff": 0.1,
                "mismatch/max_abs_diff": 0.9,
                **{f"time/{p}": step for p in ("rollout", "eval", "update", "sync", "step")},
            }
            for i in range(3)
        ]
        (d / "gpu_jetrl.metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    run = lambda *a: subprocess.run([sys.executable, "tools/bench/te_compare.py", *map(str, a)], capture_output=True, text=True)  # noqa: E731
    out = run(tmp_path / "local", tmp_path / "te")
    assert out.returncode == 0, out.stderr
    te_row = next(line for line in out.stdout.splitlines() if line.startswith("| jetrl | te |"))
    assert "| 3 | 0.5 | 0.1 | 1.5 | 0.1 | 0.9 |" in te_row and te_row.endswith("| 1.50x |")
    assert run(tmp_path / "none", tmp_path / "none2").returncode == 2
    out = run("--help")
    assert out.returncode == 0 and "tools/bench/te_compare.py OUT/train_local OUT/train_te" in out.stdout, out.stderr
