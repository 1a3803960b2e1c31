"""Model families, TP/FP8 alignment checks, and the one mapping table feeding export and sync."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.convert.synthetic import random_hf_state
from megatron_jetrl.fp8 import PrecisionFlow, quantize_blockwise
from megatron_jetrl.models import ModelArch, from_hf, hf_tensors, model_entries, padded_vocab_size, rank_slice

QWEN25_7B = dict(
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
)
LLAMA31_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)


def tiny(model_type="qwen3", **overrides):
    config = dict(
        model_type=model_type,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=300,
    )
    config.update(overrides)
    return ModelArch.from_hf_config(config)


def test_families_from_hf_config():
    q2, q3, ll = (ModelArch.from_hf_config(c) for c in (QWEN25_7B, QWEN3_8B, LLAMA31_8B))
    assert (q2.qkv_bias, q2.qk_norm, q2.head_dim, q2.q_per_group) == (True, False, 128, 7)
    assert (q3.qkv_bias, q3.qk_norm) == (False, True)
    assert (ll.family, ll.qkv_bias, ll.head_dim) == ("llama", False, 128)
    with pytest.raises(ValueError, match="model_type='mistral'.*supports"):
        ModelArch.from_hf_config(dict(QWEN3_8B, model_type="mistral"))


def test_fp8_tp_alignment_of_real_models():
    q2 = ModelArch.from_hf_config(QWEN25_7B)
    for tp in (1, 2, 4):
        q2.check_fp8_tp(tp)
    with pytest.raises(ValueError, match="TP=8 does not divide num_key_value_heads=4"):
        q2.check_fp8_tp(8)
    for tp in (1, 2, 4, 8):
        ModelArch.from_hf_config(QWEN3_8B).check_fp8_tp(tp)
        ModelArch.from_hf_config(LLAMA31_8B).check_fp8_tp(tp)


def test_misaligned_model_is_refused_with_layer_dimension_and_working_tp():
    arch = tiny(intermediate_size=384)
    arch.check_fp8_tp(1)
    with pytest.raises(ValueError, match=r"mlp.linear_fc1 gate/up rows.*384 / 2 = 192.*TP sizes that work for it: \[1\]"):
        arch.check_fp8_tp(2)
    with pytest.raises(ValueError, match=r"k and v rows of one query group \(head_dim\): 64"):
        tiny(head_dim=64).check_fp8_tp(1)


def import_ranks(arch, hf, tp):
    """HF -> Megatron for every TP rank: each rank slices only its part of each HF tensor."""
    padded = padded_vocab_size(arch.vocab_size, tp)
    ranks = []
    for r in range(tp):
        local = {}
        for e in model_entries(arch):
            local[e.megatron] = from_hf(e, arch, {n: rank_slice(e, hf[n], r, tp, padded) for n in e.hf})
        ranks.append(local)
    return ranks


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_import_then_bf16_export_round_trips(family, tp):
    arch = tiny(family)
    hf = random_hf_state(arch)
    ranks = import_ranks(arch, hf, tp)
    assert ranks[0]["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(300, tp) // tp
    out = dict(hf_tensors(arch, PrecisionFlow(mode="bf16"), model_entries(arch), lambda n: [r[n] for r in ranks]))
    assert out.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(out[name], tensor), name


@settings(max_examples=10, deadline=None)
@given(
    family=st.sampled_from(["qwen2", "qwen3", "llama"]), scale_mode=st.sampled_from(["fp32", "ue8m0"]), seed=st.integers(0, 999)
)
def test_fp8_export_is_the_trainer_bytes_and_tp_invariant(family, scale_mode, seed):
    arch = tiny(family)
    hf = random_hf_state(arch, seed)
    flow = PrecisionFlow(scale_mode=scale_mode)
    exports = []
    for tp in (1, 2):
        ranks = import_ranks(arch, hf, tp)
        exports.append(dict(hf_tensors(arch, flow, model_entries(arch), lambda n: [r[n] for r in ranks])))
    one, two = exports
    assert one.keys() == two.keys()
    for name in one:
        assert one[name].dtype == two[name].dtype and torch.equal(one[name].view(torch.uint8), two[name].view(torch.uint8)), name
    fp8_names = [n for n in one if n.endswith("weight_scale_inv")]
    assert len(fp8_names) == 7 * arch.num_layers
    for scale_name in fp8_names:
        name = scale_name.removesuffix("_scale_inv")
        q, s = quantize_blockwise(hf[name], (128, 128), scale_mode)
        assert torch.equal(one[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(one[scale_name], s)


@pytest.mark.parametrize("model_type, tied", [("qwen2", True), ("qwen3", False), ("llama", False)])
@pytest.mark.parametrize("mode", ["bf16", "jetrl"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_stream_layout_is_what_each_stage_streams(model_type, tied, mode, tp, pp):
    """What a pipeline stage's receivers allocate (`stream_layout`, from the mapping table alone) is, name by name and
    in order, what that stage's `hf_tensors` yields: names, shapes and dtypes (FP8 bytes and their scale grids)."""
    from megatron_jetrl.convert.synthetic import random_hf_state, tiny_config
    from megatron_jetrl.models.export import stream_layout

    arch = ModelArch.from_hf_config(tiny_config(model_type, num_hidden_layers=4, tie_word_embeddings=tied))
    flow = PrecisionFlow(mode=mode)
    state = random_hf_state(arch, seed=3)
    padded = padded_vocab_size(arch.vocab_size, tp)
    for stage in range(pp):
        entries = model_entries(arch, pp_rank=stage, pp_size=pp)
        by_name = {e.megatron: e for e in entries}

        def fetch(name):
            entry = by_name[name]
            return [from_hf(entry, arch, {n: rank_slice(entry, state[n], r, tp, padded) for n in entry.hf}) for r in range(tp)]

        streamed = [(name, tuple(t.shape), t.dtype) for name, t in hf_tensors(arch, flow, entries, fetch)]
        assert streamed == stream_layout(arch, flow, entries)
        assert any(dtype == torch.float8_e4m3fn for *_, dtype in streamed) == (mode == "jetrl")


@settings(max_examples=60, deadline=None)
@given(num_layers=st.integers(1, 48), pp=st.integers(1, 8), last=st.integers(0, 48))
def test_pipeline_stages_hold_every_layer_once_in_order(num_layers, pp, last):
    """`stage_layers` splits as megatron does (evenly, or `last` on the last stage and the rest evenly) or refuses; the
    stages' entries are PP 1's, in order, each layer once, the embedding on the first and the output layer on the last."""
    from megatron_jetrl.convert.synthetic import tiny_config
    from megatron_jetrl.models.mapping import stage_layers

    fits = (not last and num_layers % pp == 0) or (pp > 1 and 0 < last < num_layers and (num_layers - last) % (pp - 1) == 0)
    if not fits:
        with pytest.raises(ValueError, match=r"parallel\.pp"):
            stage_layers(num_layers, pp, last)
        return
    layers = stage_layers(num_layers, pp, last)
    assert sum(layers) == num_layers and len(layers) == pp and min(layers) >= 1 and len(set(layers[:-1])) <= 1
    assert layers[-1] == (last or num_layers // pp)
    arch = ModelArch.from_hf_config(tiny_config("qwen3", num_hidden_layers=num_layers, tie_word_embeddings=False))
    whole = [(e.megatron, e.hf) for e in model_entries(arch)]
    staged = [model_entries(arch, pp_rank=r, pp_size=pp, last_layers=last) for r in range(pp)]
    hf_names = [e.hf for stage in staged for e in stage]
    assert sorted(hf_names) == sorted(h for _, h in whole) and len(set(hf_names)) == len(hf_names)
    assert staged[0][0].megatron == "embedding.word_embeddings.weight" and staged[-1][-1].megatron == "output_layer.weight"
    for r, stage in enumerate(staged):  # local layer numbers 0.. on each stage, global ones contiguous across stages
        hf_layers = sorted({int(h[0].split(".")[2]) for e in stage for h in [e.hf] if h[0].startswith("model.layers.")})
        assert hf_layers == list(range(sum(layers[:r]), sum(layers[: r + 1])))
