"""The actor model at TP1 in this process: FP8 really is in the native spec's forward, HF import equals an
independent torch reference bit for bit, the FP8 weights per module are the bytes the rollout gets, misaligned
TP is refused at start-up, and the TE path's config (TE itself cannot run here)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from actor_helpers import (
    CONFIGS,
    SEQ,
    fp8_reference_linear,
    hf_state,
    one_gloo_rank,
    reference_logits,
    rounded_state,
    tokens_for,
    write_hf_checkpoint,
)

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, fp8_linear, fp8_linear_forward
from megatron_jetrl.models.arch import ModelArch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU, one gloo rank")
JETRL = PrecisionFlow(mode="jetrl", backend="emulated")
BF16 = PrecisionFlow(mode="bf16")


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    yield from one_gloo_rank()


@pytest.fixture(scope="module")
def checkpoints():
    with tempfile.TemporaryDirectory() as d:
        states = {}
        for family, config in CONFIGS.items():
            states[family] = hf_state(config)
            write_hf_checkpoint(Path(d) / family, config, states[family], sharded=family == "llama")
        yield Path(d), states


def _imported(family, flow, root):
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.provider import build_model

    arch = ModelArch.from_hf_config(CONFIGS[family])
    model = build_model(arch, flow)
    load_hf_weights(model, arch, root / family)
    return model.eval(), arch


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).unsqueeze(0).expand_as(tokens), None)[..., : CONFIGS["qwen3"]["vocab_size"]]


def test_native_fp8_linears_run_the_core_fp8_linear():
    from megatron.core.transformer import TransformerConfig

    from megatron_jetrl.actor.fp8_layers import FP8ColumnParallelLinear, FP8RowParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=2, use_cpu_initialization=True)
    init = lambda w: torch.nn.init.normal_(w, std=0.05)  # noqa: E731
    col = FP8ColumnParallelLinear(256, 384, config=config, init_method=init, bias=True, gather_output=False, flow=JETRL)
    row = FP8RowParallelLinear(
        384, 256, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False, flow=JETRL
    )
    x = torch.randn(32, 2, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y, _ = col(x)
    z, _ = row(y)
    ref_y = fp8_linear_forward(x, QuantizedWeight.quantize(col.weight, JETRL), col.bias, flow=JETRL)
    assert torch.equal(y, ref_y)  # the core FP8 forward, bit for bit
    assert not torch.allclose(y, F.linear(x, col.weight, col.bias), atol=1e-3)  # and not a plain GEMM
    assert torch.equal(z, fp8_linear_forward(y, QuantizedWeight.quantize(row.weight, JETRL), flow=JETRL))
    # backward = the core's FP8 DGrad/WGrad
    z.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w1, b1, w2 = (t.detach().clone().requires_grad_() for t in (col.weight, col.bias, row.weight))
    fp8_linear(fp8_linear(x2, w1, b1, flow=JETRL), w2, flow=JETRL).sum().backward()
    for got, want in ((x.grad, x2.grad), (col.weight.grad, w1.grad), (row.weight.grad, w2.grad), (col.bias.grad, b1.grad)):
        assert torch.equal(got, want)
    # quantized once per weight version: same object until the weight changes in place
    assert col.quantized_weight() is col.quantized_weight()
    before = col.quantized_weight()
    with torch.no_grad():
        col.weight.mul_(1.5)
    assert col.quantized_weight() is not before


def test_weight_transpose_per_backward_gives_the_same_gradients_and_keeps_no_copy():
    """model.fp8_weight_t=backward: DGrad's W^T bytes are made in each backward and dropped; the gradients are those of
    the kept W^T (step) bit for bit, over two micro-batches of one weight version."""
    from megatron.core.transformer import TransformerConfig

    from megatron_jetrl.actor.fp8_layers import FP8ColumnParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=2, use_cpu_initialization=True)
    grads = {}
    for weight_t in ("step", "backward"):
        torch.manual_seed(3)
        col = FP8ColumnParallelLinear(
            256,
            384,
            config=config,
            init_method=lambda w: torch.nn.init.normal_(w, std=0.05),
            bias=False,
            gather_output=False,
            flow=JETRL,
        )
        col.keep_weight_t = weight_t == "step"
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(32, 2, 256, generator=g, requires_grad=True) for _ in range(2)]
        for x in xs:
            col(x)[0].square().sum().backward()
        cached = col.quantized_weight()
        assert (cached._t is not None) == (weight_t == "step")
        assert torch.equal(cached.transposed()[0].view(torch.uint8), cached.q.t().contiguous().view(torch.uint8))
        assert (cached._t is not None) == (weight_t == "step")  # asking again keeps nothing either
        grads[weight_t] = [col.weight.grad, *(x.grad for x in xs)]
    assert all(torch.equal(a, b) for a, b in zip(grads["step"], grads["backward"]))
    from megatron_jetrl.actor.fp8_layers import _FP8Weight
    from megatron_jetrl.actor.provider import ActorOptions, build_model

    for weight_t in ("step", "backward"):  # the option reaches every FP8 linear of a built actor
        model = build_model(ModelArch.from_hf_config(CONFIGS["qwen3"]), JETRL, ActorOptions(fp8_weight_t=weight_t))
        keeps = {m.keep_weight_t for m in model.modules() if isinstance(m, _FP8Weight)}
        assert keeps == {weight_t == "step"}


@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_hands_fc1_its_fp8_gradient_from_fc2(monkeypatch, bias):
    """FP8GatedMLP (SwiGLU) forward and backward are the core FP8 linears' bit for bit. Bias-free, fc2's backward
    quantizes d[gate | up] for fc1 (one GatedGradHandoff per forward); with a bias, fc1 gets d[gate | up] in BF16."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_jetrl.actor.fp8_layers import FP8ColumnParallelLinear, FP8GatedMLP, FP8RowParallelLinear
    from megatron_jetrl.fp8 import linear as fp8_linear_module

    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        ffn_hidden_size=384,
        num_attention_heads=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=bias,
        use_cpu_initialization=True,
    )
    mlp = FP8GatedMLP(
        config,
        MLPSubmodules(
            linear_fc1=ModuleSpec(module=FP8ColumnParallelLinear, params={"flow": JETRL}),
            linear_fc2=ModuleSpec(module=FP8RowParallelLinear, params={"flow": JETRL}),
        ),
    )
    handed = []
    real = fp8_linear_module._quantize_gated_grad
    monkeypatch.setattr(fp8_linear_module, "_quantize_gated_grad", lambda *a: handed.append(1) or real(*a))
    x = torch.randn(40, 2, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, out_bias = mlp(x)
    y.sum().backward()
    assert len(handed) == (0 if bias else 1)
    x2 = x.detach().clone().requires_grad_()
    w1, w2 = (t.detach().clone().requires_grad_() for t in (mlp.linear_fc1.weight, mlp.linear_fc2.weight))
    b1 = mlp.linear_fc1.bias.detach().clone().requires_grad_() if bias else None
    gate_up = fp8_linear(x2, w1, b1, flow=JETRL)
    want = fp8_linear(gate_up, w2, flow=JETRL, gated_act=F.silu)
    want.sum().backward()
    assert torch.equal(y, want)
    for got, ref in ((x.grad, x2.grad), (mlp.linear_fc1.weight.grad, w1.grad), (mlp.linear_fc2.weight.grad, w2.grad)):
        assert torch.equal(got, ref)
    if bias:
        assert torch.equal(mlp.linear_fc1.bias.grad, b1.grad)
    assert mlp.linear_fc1.grad_handoff is None and mlp.linear_fc2.grad_handoff is None


def test_megatron_fp8_flag_on_local_spec_builds_plain_linears(checkpoints):
    """Why the native spec exists: megatron's own fp8='e4m3' + blockwise on the local spec is silently BF16."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_jetrl.actor.fp8_layers import FP8ColumnParallelLinear, native_layer_spec
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.provider import rope_kwargs, transformer_config

    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert local.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    root, states = checkpoints
    arch = ModelArch.from_hf_config(CONFIGS["llama"])
    config = transformer_config(arch, BF16, tp=1, pp=1)
    config.fp8, config.fp8_recipe = "e4m3", "blockwise"
    model = GPTModel(config=config, transformer_layer_spec=local, vocab_size=384, max_sequence_length=64, **rope_kwargs(arch))
    load_hf_weights(model, arch, root / "llama")
    tokens, ref_state = tokens_for(CONFIGS["llama"]), rounded_state(states["llama"])
    logits = _logits(model.eval(), tokens)
    ref_bf16 = reference_logits(CONFIGS["llama"], ref_state, tokens)
    torch.testing.assert_close(logits, ref_bf16, atol=1e-5, rtol=0)  # (torch's RMSNorm: last bits differ)
    assert (logits - reference_logits(CONFIGS["llama"], ref_state, tokens, fp8_reference_linear(JETRL))).abs().max() > 0.1
    ours = native_layer_spec(JETRL, ModelArch.from_hf_config(CONFIGS["qwen2"])).submodules.self_attention.submodules.linear_qkv
    assert ours.module is FP8ColumnParallelLinear and ours.params["flow"] is JETRL


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_import_equals_reference_and_fp8_is_in_the_forward(family, checkpoints):
    root, states = checkpoints
    config, ref_state = CONFIGS[family], rounded_state(states[family])  # the checkpoint holds BF16
    tokens = tokens_for(config)
    ref_bf16 = reference_logits(config, ref_state, tokens)
    ref_fp8 = reference_logits(config, ref_state, tokens, fp8_reference_linear(JETRL))
    bf16_model, _ = _imported(family, BF16, root)
    fp8_model, _ = _imported(family, JETRL, root)
    # The reference follows megatron's op order (actor_helpers._attention), so equality is exact here, except that on
    # AVX2 CPUs (CI's AMD EPYC) qwen2's q/k/v bias added by the fused QKV GEMM differs from the split reference in the
    # last bit (measured 2.9e-6 of logits ~7.6); the FP8 forward stays bit-equal (its GEMM is the emulated one).
    torch.testing.assert_close(_logits(bf16_model, tokens), ref_bf16, atol=1e-5, rtol=0)
    assert torch.equal(_logits(fp8_model, tokens), ref_fp8)
    assert (ref_fp8 - ref_bf16).abs().max() > 0.1  # FP8 changes the logits (~0.3-0.45 here)
    # mode bf16-train-fp8-rollout trains with the same plain linears as bf16
    foil_model, _ = _imported(family, PrecisionFlow(mode="bf16-train-fp8-rollout"), root)
    assert torch.equal(_logits(foil_model, tokens), _logits(bf16_model, tokens))


def test_logprobs_equal_log_softmax_of_reference(checkpoints):
    from megatron_jetrl.actor.logprobs import compute_logprobs

    root, states = checkpoints
    config = CONFIGS["qwen2"]
    tokens = tokens_for(config)
    model, arch = _imported("qwen2", JETRL, root)
    got = compute_logprobs(model, tokens, vocab_size=arch.vocab_size, micro_batch_size=2, temperature=0.7)
    ref = reference_logits(config, rounded_state(states["qwen2"]), tokens, fp8_reference_linear(JETRL)) / 0.7
    want = torch.log_softmax(ref, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert got.shape == (4, SEQ - 1)
    # padded vocab columns (300 -> 384) are masked; megatron's CE vs log_softmax: a few ulps of log-sum-exp
    torch.testing.assert_close(got, want, atol=5e-6, rtol=0)


def test_fp8_weights_are_the_rollout_bytes(checkpoints):
    """fp8_weights(model) -> models.export.hf_tensors gives exactly quantize(HF weight) per HF linear."""
    from megatron_jetrl.actor.fp8_layers import fp8_weights
    from megatron_jetrl.models.export import hf_tensors
    from megatron_jetrl.models.mapping import model_entries

    root, states = checkpoints
    model, arch = _imported("qwen3", JETRL, root)
    weights, params = fp8_weights(model), dict(model.named_parameters())
    entries = model_entries(arch)
    assert set(weights) == {e.megatron for e in entries if e.fp8}
    exported = dict(hf_tensors(arch, JETRL, entries, lambda n: [params[n]], lambda n: [weights[n]]))
    hf = rounded_state(states["qwen3"])
    for name in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    ):
        want = QuantizedWeight.quantize(hf[name], JETRL)
        assert torch.equal(exported[name].view(torch.uint8), want.q.view(torch.uint8)), name
        assert torch.equal(exported[name.replace("weight", "weight_scale_inv")], want.s), name


def test_a_frozen_reference_keeps_no_transposed_weight_bytes(checkpoints):
    """The KL reference (requires_grad False) runs no backward: its FP8 linears hold W's bytes, never DGrad's W^T, and
    compute the policy's logits bit for bit; a weight that starts needing a gradient makes its W^T again."""
    from megatron_jetrl.actor.fp8_layers import _FP8Weight, fp8_weights

    root, _ = checkpoints
    policy, _ = _imported("qwen3", JETRL, root)
    reference, _ = _imported("qwen3", JETRL, root)
    reference.requires_grad_(False)
    tokens = tokens_for(CONFIGS["qwen3"], batch=2)
    assert torch.equal(_logits(policy, tokens), _logits(reference, tokens))
    mine, frozen = fp8_weights(policy), fp8_weights(reference)
    assert all(w._t is not None for w in mine.values()) and all(w._t is None for w in frozen.values())
    assert all(
        torch.equal(mine[n].q.view(torch.uint8), frozen[n].q.view(torch.uint8)) and torch.equal(mine[n].s, frozen[n].s)
        for n in mine
    )
    layer = next(m for m in reference.modules() if isinstance(m, _FP8Weight))
    layer.weight.requires_grad_(True)
    assert layer.quantized_weight()._t is not None


def test_an_offloaded_reference_runs_its_fp8_bytes_and_takes_new_weights(checkpoints):
    """`offload_frozen_weights`: a frozen FP8 linear's BF16 weight waits in host memory and its bytes are quantized
    onto `fp8_device`. On the CPU there is nothing to move (0 bytes); with host memory standing in for the device,
    the reference computes the policy's logits bit for bit, and a new value loaded into it (the policy after an
    update, as `freeze_reference` and a resume load it) is what its next forward runs."""
    from megatron_jetrl.actor.fp8_layers import _FP8Weight, offload_frozen_weights

    root, _ = checkpoints
    policy, _ = _imported("qwen3", JETRL, root)
    reference, _ = _imported("qwen3", JETRL, root)
    reference.requires_grad_(False)
    assert offload_frozen_weights(reference) == 0 and offload_frozen_weights(policy) == 0  # weights in host memory already
    layers = [m for m in reference.modules() if isinstance(m, _FP8Weight)]
    for m in layers:
        m.fp8_device = torch.device("cpu")  # what a GPU run records: the bytes are quantized from a host copy
    tokens = tokens_for(CONFIGS["qwen3"], batch=2)
    assert torch.equal(_logits(policy, tokens), _logits(reference, tokens))
    before = {id(m): m.quantized_weight() for m in layers}
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.25)
    assert not torch.equal(_logits(policy, tokens), _logits(reference, tokens))
    reference.load_state_dict(policy.state_dict())
    assert all(m.quantized_weight() is not before[id(m)] for m in layers)  # quantized again from the new values
    assert torch.equal(_logits(policy, tokens), _logits(reference, tokens))


def test_fp8_weights_check_every_weight_with_one_sync_and_name_the_bad_one(checkpoints, monkeypatch):
    """After an optimizer step `fp8_weights` quantizes every weight inside one watch (check_finite="step"): no host
    sync per weight, and a NaN weight is refused by name."""
    from megatron_jetrl.actor.fp8_layers import fp8_weights, requantize_weights
    from megatron_jetrl.fp8 import NonFiniteInputError, linear

    root, _ = checkpoints
    model, _ = _imported("qwen3", JETRL, root)
    requantize_weights(model)
    syncs = []  # check_finite of each weight quantization: True would be a host sync of its own
    real = linear.quantize_blockwise
    monkeypatch.setattr(linear, "quantize_blockwise", lambda *a, **k: (syncs.append(k.get("check_finite")), real(*a, **k))[1])
    assert len(fp8_weights(model)) == len(syncs) == 8 and not any(syncs)
    requantize_weights(model)
    layer = dict(model.named_modules())["decoder.layers.1.mlp.linear_fc2"]
    with torch.no_grad():
        layer.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteInputError, match=r"decoder\.layers\.1\.mlp\.linear_fc2: weight"):
        fp8_weights(model)


def test_misaligned_tp_is_refused_before_building():
    from megatron_jetrl.actor.provider import transformer_config

    arch = ModelArch.from_hf_config(dict(CONFIGS["qwen3"], intermediate_size=384))
    with pytest.raises(ValueError, match=r"(?s)TP=2.*mlp\.linear_fc1.*384 / 2 = 192.*TP sizes that work for it: \[1\]"):
        transformer_config(arch, JETRL, tp=2, pp=1)
    transformer_config(arch, BF16, tp=2, pp=1)  # BF16 training has no blocks to align
    transformer_config(ModelArch.from_hf_config(CONFIGS["qwen3"]), JETRL, tp=2, pp=1)


def test_pipeline_config_splits_as_asked_and_never_syncs_the_device_per_send():
    """megatron gets the last stage's own layer count, and batched pipeline send/recv without the device-wide sync that
    megatron keeps for old PyTorch (the request waits order the streams: provider's comment)."""
    from megatron_jetrl.actor.provider import ActorOptions, transformer_config

    arch = ModelArch.from_hf_config(dict(CONFIGS["qwen3"], num_hidden_layers=4))
    config = transformer_config(arch, JETRL, tp=1, pp=2, options=ActorOptions(pp_last_layers=1))
    assert config.num_layers_in_last_pipeline_stage == 1 and config.batch_p2p_comm and not config.batch_p2p_sync
    assert transformer_config(arch, JETRL, tp=1, pp=2).num_layers_in_last_pipeline_stage is None
    with pytest.raises(ValueError, match=r"parallel.pp_last_layers=4: the other 1 stage\(s\) must split the remaining 0"):
        transformer_config(arch, JETRL, tp=1, pp=2, options=ActorOptions(pp_last_layers=4))


def test_llama3_rope_scaling_and_unsupported_scaling():
    from megatron_jetrl.actor.provider import rope_kwargs

    kwargs = rope_kwargs(ModelArch.from_hf_config(CONFIGS["llama"]))
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 8.0 and kwargs["rotary_base"] == 500000.0
    yarn = dict(CONFIGS["qwen3"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="not supported"):
        rope_kwargs(ModelArch.from_hf_config(yarn))


def test_rank_slice_lazy_equals_rank_slice():
    from megatron_jetrl.models.mapping import Entry, rank_slice, rank_slice_lazy

    full = torch.randn(300, 256)
    cases = [
        Entry("e", ("x",), tp_dim=0, vocab=True),
        Entry("c", ("x",), tp_dim=0),
        Entry("r", ("x",), tp_dim=1),
        Entry("n", ("x",)),
    ]
    for entry in cases:
        for tp in (1, 2, 4):
            rows = 300 if not entry.vocab else 128 * tp * 3 if tp == 4 else 512
            if not entry.vocab and entry.tp_dim == 0 and 300 % tp:
                continue
            for r in range(tp):
                assert torch.equal(
                    rank_slice_lazy(entry, full.__getitem__, tuple(full.shape), r, tp, rows), rank_slice(entry, full, r, tp, rows)
                )


def test_te_path_config_without_te():
    from megatron.core.fp8_utils import _resolve_callable_from_python_import_path
    from megatron.core.transformer import TransformerConfig

    from megatron_jetrl.actor import te_recipe
    from megatron_jetrl.actor.provider import ActorOptions, transformer_config

    arch = ModelArch.from_hf_config(CONFIGS["qwen3"])
    config = transformer_config(
        arch, PrecisionFlow(mode="jetrl", scale_mode="ue8m0"), tp=1, pp=1, options=ActorOptions(spec="te")
    )
    assert isinstance(config, TransformerConfig) and (config.fp8, config.fp8_recipe) == ("e4m3", "custom")
    # megatron's get_fp8_recipe resolves this path and hands the callable to TE's CustomRecipe(qfactory=...)
    assert _resolve_callable_from_python_import_path(config.fp8_quantizer_factory) is te_recipe.jetrl_ue8m0_qfactory
    assert te_recipe.te_config_kwargs(PrecisionFlow(mode="jetrl"))["fp8_quantizer_factory"].endswith("jetrl_fp32_qfactory")
    assert te_recipe.te_config_kwargs(PrecisionFlow(mode="bf16-train-fp8-rollout")) == {}
    with pytest.raises(
        RuntimeError, match=r"Transformer Engine 2\.20\.2 is not importable.*bash \.kits/te/bin/build\.sh 2\.20\.2"
    ):
        te_recipe.te_layer_spec(qk_norm=True)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_import_of_a_transformers_written_checkpoint(family, tmp_path):
    """An independent producer: transformers' own model classes write the checkpoint; the actor imports it,
    matches transformers' logits, and the one mapping exports exactly the tensors transformers wrote."""
    transformers = pytest.importorskip("transformers")
    from megatron_jetrl.models import hf_tensors, model_entries

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIGS[family])
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    # `.to(bfloat16)` also rounds RoPE's FP32 inv_freq buffers; the FP32 reference below gets them back
    # (checkpoints never hold them: transformers and megatron both compute them in FP32 from the config)
    rope_buffers = {n: b.clone() for n, b in hf_model.named_buffers()}
    hf_model = hf_model.to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    written = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}

    arch = ModelArch.from_pretrained(tmp_path)
    from megatron_jetrl.actor.fp8_layers import _rotary
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.provider import build_model

    model = build_model(arch, BF16)
    load_hf_weights(model, arch, tmp_path)
    state = model.state_dict()
    exported = dict(hf_tensors(arch, BF16, model_entries(arch), lambda n: [state[n]]))
    for name, tensor in exported.items():
        assert torch.equal(tensor.view(torch.int16), written[name].view(torch.int16)), name
    assert set(written) - set(exported) <= {"lm_head.weight"} and arch.tie_word_embeddings == ("lm_head.weight" not in exported)

    hf_model = hf_model.float()
    for name, buffer in hf_model.named_buffers():
        buffer.copy_(rope_buffers[name])
    rotary = _rotary(arch.head_dim, model.decoder.layers[0].self_attention.core_attention.rope_kwargs, torch.device("cpu"))
    assert torch.equal(rotary.inv_freq, hf_model.model.rotary_emb.inv_freq)  # the core attention's RoPE, llama3 scaling included

    tokens = tokens_for(CONFIGS[family])
    with torch.no_grad():
        want = hf_model(tokens).logits.double()
    got = _logits(model.eval(), tokens).double()
    # FP32 on both sides, the same BF16-valued weights: measured 4.5e-7 .. 5.5e-7 relative, max |diff| <= 1e-6 at
    # |logit| <= 1.4 (FP32 op-order rounding). A RoPE table rounded to BF16 gave 2e-4 .. 1.6e-3, a mapping or
    # rope_theta error ~0.3, FP8 ~0.05-0.3.
    assert ((got - want).norm() / want.norm()).item() < 4e-6
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("flow", [BF16, JETRL], ids=["bf16", "jetrl"])
def test_fused_wgrad_accumulation_adds_what_ddp_adds(flow, checkpoints):
    """megatron's gradient accumulation fusion through patches/megatron_core_0_16_1_wgrad_fusion.py, in megatron's own
    backward: after a step of two micro-batches every main_grad equals the unfused run's within FP32 summation
    error (nothing added twice, nothing lost), and exactly megatron's own linears were switched (all in bf16 mode,
    the lm_head in jetrl, whose FP8 linears accumulate themselves)."""
    from actor_scenario import MICRO, grpo_like_loss
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.actor.wgrad_fusion import fuse_wgrad_accumulation

    root, _ = checkpoints
    tokens, vocab = tokens_for(CONFIGS["qwen3"], batch=4, seed=3), CONFIGS["qwen3"]["vocab_size"]
    grads, switched = {}, {}
    for fused in (False, True):
        model, _ = _imported("qwen3", flow, root)
        ddp, optimizer = wrap_for_training(model.train(), OptimConfig(lr=1e-3, wgrad_fusion=False))
        switched[fused] = fuse_wgrad_accumulation(ddp) if fused else 0
        out = train_step(
            ddp,
            optimizer,
            tokens,
            grpo_like_loss,
            vocab_size=vocab,
            micro_batch_size=MICRO,
            extras={"advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])},
        )
        assert out["ok"]
        grads[fused] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        megatron_linears = [m for m in model.modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)]
        assert all(m.gradient_accumulation_fusion == fused for m in megatron_linears)
    assert switched[True] == (1 + 4 * CONFIGS["qwen3"]["num_hidden_layers"] if flow is BF16 else 1)
    for name, want in grads[False].items():
        torch.testing.assert_close(grads[True][name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=name)


def test_fused_wgrad_gemm_check():
    """The once-per-device check: FP32 on CPU passes (and the stand-in adds dy^T x within FP32 summation error);
    BF16 operands on CPU (no `addmm.dtype` kernel there) and a BF16 main_grad are refused with the reason."""
    from megatron_jetrl.actor.wgrad_fusion import PATCH, _check
    from megatron_jetrl.patching import load_patch

    cpu = torch.device("cpu")
    assert _check(cpu, torch.float32, torch.float32) is None
    assert "addmm" in _check(cpu, torch.bfloat16, torch.float32)
    assert "float32 only" in _check(cpu, torch.float32, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x, dy, acc = torch.randn(300, 40, generator=g), torch.randn(300, 24, generator=g), torch.randn(24, 40, generator=g)
    want = acc.double() + dy.double().t() @ x.double()
    load_patch(PATCH).wgrad_gemm_accum_fp32(x, dy, acc)
    bound = 300 * torch.finfo(torch.float32).eps * (want.abs() + dy.double().abs().t() @ x.double().abs())
    assert bool(((acc.double() - want).abs() <= bound).all())


def test_grad_clip_scales_in_place_bit_for_bit(checkpoints):
    """patches/megatron_core_0_16_1_grad_clip_scale.py: megatron's clipping (without apex/TE) scales the gradients in
    place with one multi-tensor multiply, the same FP32 products as megatron's `dst.copy_(src * scale)` loop (signed
    zeros, subnormals, huge values, NaN/Inf included); wrap_for_training installs it, and a clipped train step
    leaves exactly the weights megatron's own loop leaves."""
    from actor_scenario import MICRO, grpo_like_loss
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.patching import load_patch

    patch = load_patch("megatron_core_0_16_1_grad_clip_scale")
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 3.4e38, -1e30, float("inf"), float("nan"), 1.0, -7.25])
    shapes = [(1,), (3, 5), (1000,), (64, 65), (0,)]
    for scale in (0.3, 1e-7, 0.999999, 2.5e-3):
        tensors = [torch.randn(*s, generator=g) * torch.exp(torch.randn(1, generator=g) * 20) for s in shapes] + [special]
        want = [t.clone() for t in tensors]
        utils.local_multi_tensor_scale(2048 * 32, None, [want, want], scale)
        got = [t.clone() for t in tensors]
        patch.foreach_multi_tensor_scale(2048 * 32, None, [got, got], scale)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want)), scale
        out = [torch.empty_like(t) for t in tensors]  # not in place: megatron's loop
        patch.foreach_multi_tensor_scale(2048 * 32, None, [tensors, out], scale)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(out, want))

    root, _ = checkpoints
    tokens, vocab = tokens_for(CONFIGS["qwen3"], batch=4, seed=3), CONFIGS["qwen3"]["vocab_size"]
    weights = {}
    for scale_impl in ("megatron", "patched"):
        model, _ = _imported("qwen3", BF16, root)
        ddp, optimizer = wrap_for_training(model.train(), OptimConfig(lr=1e-3, clip_grad=1e-3))  # always clips
        assert clip_grads.multi_tensor_scale_impl is patch.foreach_multi_tensor_scale
        if scale_impl == "megatron":
            clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
        out = train_step(
            ddp,
            optimizer,
            tokens,
            grpo_like_loss,
            vocab_size=vocab,
            micro_batch_size=MICRO,
            extras={"advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])},
        )
        assert out["ok"] and out["grad_norm"] > 1e-3
        weights[scale_impl] = {n: p.detach().clone() for n, p in model.named_parameters()}
    patch.apply()
    for name, want in weights["megatron"].items():
        assert torch.equal(weights["patched"][name], want), name


@pytest.mark.parametrize("flow", [BF16, JETRL], ids=["bf16", "jetrl"])
def test_prompt_positions_get_no_logits(flow, checkpoints):
    """rl.train passes each row's first response column (`response_start`, `extras["first"]`): a micro-batch's output
    layer then runs from its smallest one on. The logprobs from there on, the loss and every main_grad after a step
    equal the full computation's (FP32 rounding of shorter sums); the columns before are 0; a device tensor is refused."""
    from actor_scenario import MICRO

    from megatron_jetrl.actor.logprobs import compute_logprobs, response_start
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.grpo.loss import PolicyLossConfig, policy_loss

    root, _ = checkpoints
    tokens, vocab = tokens_for(CONFIGS["qwen3"], batch=4, seed=3), CONFIGS["qwen3"]["vocab_size"]
    s = tokens.shape[1]
    mask = torch.zeros(4, s - 1)
    for row, p in enumerate((3, 5, 2, s - 2)):
        mask[row, p:] = 1
    first = response_start(mask)
    assert first.tolist() == [3, 5, 2, s - 2] and response_start(torch.zeros(2, 5)).tolist() == [0, 0]
    cfg = PolicyLossConfig(kl_estimator="none")

    def loss_fn(lp, ex):
        return policy_loss(lp, ex["old"], ex["adv"], ex["mask"], cfg=cfg, checked=True)

    runs = {}
    for window in (False, True):
        model, _ = _imported("qwen3", flow, root)
        ddp, optimizer = wrap_for_training(model.train(), OptimConfig(lr=1e-3))
        lp = compute_logprobs(ddp, tokens, vocab_size=vocab, micro_batch_size=MICRO, first=first if window else None)
        extras = {"old": torch.full_like(mask, -3.0), "adv": torch.tensor([1.0, -1.0, 0.5, -0.5]), "mask": mask}
        out = train_step(
            ddp,
            optimizer,
            tokens,
            loss_fn,
            vocab_size=vocab,
            micro_batch_size=MICRO,
            extras={**extras, "first": first} if window else extras,
        )
        assert out["ok"]
        runs[window] = lp, out["loss"], {n: p.main_grad.clone() for n, p in model.named_parameters()}
    (full, full_loss, full_grads), (part, part_loss, part_grads) = runs[False], runs[True]
    for rows in range(0, 4, MICRO):
        start = int(first[rows : rows + MICRO].min())
        assert start > 0 and not part[rows : rows + MICRO, :start].any()
        torch.testing.assert_close(part[rows : rows + MICRO, start:], full[rows : rows + MICRO, start:], rtol=1e-6, atol=1e-6)
    assert part_loss == pytest.approx(full_loss, rel=1e-6)
    for name, want in full_grads.items():
        torch.testing.assert_close(part_grads[name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=name)
    with pytest.raises(ValueError, match=r"extras\['first'\] must be a CPU tensor"):
        compute_logprobs(ddp, tokens, vocab_size=vocab, micro_batch_size=MICRO, first=first.to("meta"))


def test_token_multiple_fills_whole_k_blocks():
    from megatron_jetrl.fp8.gemm import K_BLOCK, token_multiple

    for micro, multiple in ((1, 128), (4, 32), (6, 64), (16, 8), (128, 1), (256, 1)):
        assert token_multiple(micro) == multiple and (micro * multiple) % K_BLOCK == 0
    # under sequence parallelism each of the TP ranks' equal parts of the micro-batch is whole blocks too
    for micro, shards, multiple in ((1, 2, 256), (4, 2, 64), (4, 4, 128), (256, 2, 2), (512, 4, 4), (3, 8, 1024)):
        got = token_multiple(micro, shards)
        assert got == multiple and got % shards == 0 and (micro * got // shards) % K_BLOCK == 0, (micro, shards, got)


@pytest.mark.parametrize("flow", [BF16, JETRL], ids=["bf16", "jetrl"])
def test_sequences_lengthened_for_fp8_blocks_train_as_the_unpadded_ones(flow, checkpoints, monkeypatch):
    """Where FP8 linears train on a GPU, train_step lengthens the sequences to whole 128-token blocks per micro-batch
    (stood in for here: the CPU's emulated GEMM needs none). The padding is masked: the loss is the unpadded one and
    every main_grad is the same in BF16 (FP32 sums over a few more zero rows); in jetrl WGrad's 128-token groups start
    at other tokens, so its gradients move by FP8 noise alone. `pad_length` lengthens the per-token extras only."""
    from actor_scenario import MICRO

    from megatron_jetrl.actor import fp8_layers
    from megatron_jetrl.actor.logprobs import pad_length
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.grpo.loss import PolicyLossConfig, policy_loss

    root, _ = checkpoints
    tokens, vocab = tokens_for(CONFIGS["qwen3"], batch=4, seed=5), CONFIGS["qwen3"]["vocab_size"]
    s = tokens.shape[1]
    mask = torch.zeros(4, s - 1)
    for row, p in enumerate((3, 5, 2, 7)):
        mask[row, p:] = 1
    extras = {"old": torch.full_like(mask, -3.0), "adv": torch.tensor([1.0, -1.0, 0.5, -0.5]), "mask": mask}
    longer, padded = pad_length(tokens, extras, 24)
    assert longer.shape == (4, 48) and torch.equal(longer[:, :s], tokens) and (longer[:, s:] == tokens[:, -1:]).all()
    assert padded["mask"].shape == (4, 47) and not padded["mask"][:, s - 1 :].any() and padded["adv"] is extras["adv"]
    assert pad_length(tokens, extras, 8) == (tokens, extras)  # 32 tokens: nothing to add
    cfg = PolicyLossConfig(kl_estimator="none")
    seen = []

    def loss_fn(lp, ex):
        seen.append(lp.shape[1])
        return policy_loss(lp, ex["old"], ex["adv"], ex["mask"], cfg=cfg, checked=True)

    runs = {}
    for fp8_gpu in (False, True):
        monkeypatch.setattr(fp8_layers, "trains_fp8_on_cuda", lambda model: fp8_gpu)
        monkeypatch.setattr("megatron_jetrl.actor.train_step.token_multiple", lambda micro, shards: 24)
        model, _ = _imported("qwen3", flow, root)
        ddp, optimizer = wrap_for_training(model.train(), OptimConfig(lr=1e-3))
        out = train_step(ddp, optimizer, tokens, loss_fn, vocab_size=vocab, micro_batch_size=MICRO, extras=extras)
        assert out["ok"]
        runs[fp8_gpu] = out["loss"], {n: p.main_grad.clone() for n, p in model.named_parameters()}
    assert seen == [s - 1] * (4 // MICRO) + [47] * (4 // MICRO)
    (loss, grads), (padded_loss, padded_grads) = runs[False], runs[True]
    assert padded_loss == pytest.approx(loss, rel=1e-6)
    for name, want in grads.items():
        if flow.train_fp8:
            err = float((padded_grads[name] - want).norm() / want.norm())
            assert err < 0.05, (name, err)  # measured: at most 0.012
        else:
            torch.testing.assert_close(padded_grads[name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=name)


def test_megatron_patches_refuse_another_release(monkeypatch):
    from megatron.core import package_info

    from megatron_jetrl.patching import load_patch

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    for name in ("megatron_core_0_16_1_grad_clip_scale", "megatron_core_0_16_1_wgrad_fusion"):
        with pytest.raises(RuntimeError, match=rf"patches/{name}\.py targets megatron-core==0\.16\.1, found 0\.17\.0: pin"):
            load_patch(name).apply()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_memory_preflight_counts_the_actors_parameters(family):
    """rl/preflight.actor_state_bytes counts what megatron builds (norms and biases as upper bounds): within 0.2%."""
    from megatron_jetrl.actor.provider import build_model
    from megatron_jetrl.rl.config import load_config
    from megatron_jetrl.rl.preflight import actor_state_bytes

    built = sum(p.numel() for p in build_model(ModelArch.from_hf_config(CONFIGS[family]), JETRL).parameters())
    hf = ", ".join(f"{k}: {v}" for k, v in CONFIGS[family].items())
    counted = actor_state_bytes(load_config(None, [f"model.hf_config={{{hf}}}"]))["gradients"] / 4
    assert built <= counted <= 1.002 * built, (built, counted)


@pytest.mark.parametrize(
    "num_layers, pp, last",
    [(4, 2, 0), (4, 2, 1), (4, 2, 3), (4, 3, 2), (36, 4, 0), (36, 4, 6), (36, 4, 3), (64, 2, 31), (12, 4, 0), (13, 4, 4)],
)
def test_the_stage_split_is_megatrons(num_layers, pp, last):
    """`models.mapping.stage_layers` (the mapping table, checkpoints, the converter) gives every stage the layers
    megatron builds there and at the offset megatron numbers them from."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_jetrl.actor.provider import ActorOptions, transformer_config
    from megatron_jetrl.models.mapping import stage_layers

    arch = ModelArch.from_hf_config(dict(CONFIGS["qwen3"], num_hidden_layers=num_layers))
    config = transformer_config(arch, BF16, tp=1, pp=pp, options=ActorOptions(pp_last_layers=last))
    layers = stage_layers(num_layers, pp, last)
    assert [get_num_layers_to_build(config, pp_rank=r) for r in range(pp)] == list(layers)
    assert [get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)] == [sum(layers[:r]) for r in range(pp)]
