"""The FP8 KV cache's scales on the CPU: the trainer's policies, the mapping table's entry that carries them, the sync
into vLLM's attention buffers, the engine read-back's refusals and the cache's size. The FP8 attention itself and the
bytes against vLLM run on the GPU (tests/gpu/test_exact_logprobs.py)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rollout_native import bf16_state, tiny_config
from test_rollout_vllm import vllm_params

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.models.export import hf_tensors, stream_layout
from megatron_jetrl.models.mapping import KV_SCALE, from_hf, model_entries, to_hf
from megatron_jetrl.rl import kv_scales as kv
from megatron_jetrl.rollout.colocated import kv_bytes_per_token, kv_cache_need, sequences_at_once
from megatron_jetrl.rollout.native import expected_tensors, validate_weights
from megatron_jetrl.rollout.vllm_checks import EngineConformanceError, kv_cache_problems
from megatron_jetrl.rollout.vllm_engine import llm_kwargs, write_model_dir
from megatron_jetrl.rollout.vllm_params import apply_plan, copy_plan, kv_scale_params, sync_scale_floats

FP8_KV = PrecisionFlow("jetrl", exact_logprobs=True, kv_cache="fp8")


def test_the_policies_turn_amax_into_scales():
    start = kv.KvScaleState.start(2)
    amax = torch.tensor([[448.0, 44.8, 4.48], [0.0, 0.0, 0.0]])
    for policy in ("amax", "running_max", "fixed"):
        got = kv.decide(policy, amax, start)
        assert torch.equal(got.scales[0], torch.tensor([1.0, 0.1, 0.01])) and got.decided
        assert torch.equal(got.scales[1], torch.ones(3))  # a layer that saw nothing keeps its scale
    first = kv.decide("amax", amax, start)
    lower = amax / 4
    assert torch.equal(kv.decide("amax", lower, first).scales[0], amax[0] / 4 / 448)  # the last step's amax
    assert torch.equal(kv.decide("running_max", lower, first).scales[0], amax[0] / 448)  # the largest so far
    fixed = kv.decide("fixed", amax, start)
    assert torch.equal(kv.decide("fixed", lower * 100, fixed).scales, fixed.scales)  # decided once
    assert torch.equal(kv.decide("amax", torch.zeros(2, 3), start).scales, start.scales)  # the first sync: 1.0
    with pytest.raises(ValueError, match="engine"):
        kv.decide("engine", amax, start)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1e4, allow_subnormal=False), min_size=6, max_size=6), min_size=1, max_size=5))
def test_running_max_scales_never_saturate_what_was_seen_and_stay_positive(steps):
    state = kv.KvScaleState.start(2)
    seen = torch.zeros(2, 3)
    for values in steps:
        amax = torch.tensor(values, dtype=torch.float32).view(2, 3)
        seen = torch.maximum(seen, amax)
        state = kv.decide("running_max", amax, state)
        assert torch.isfinite(state.scales).all() and (state.scales > 0).all()
        assert (seen / state.scales <= 448 * (1 + 1e-6)).all()
    assert kv.KvScaleState.from_dict(state.to_dict()).to_dict() == state.to_dict()  # what a checkpoint keeps


class _Core(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_fp8 = True
        self.register_buffer("kv_scale", torch.ones(3), persistent=False)
        self.register_buffer("kv_amax", torch.zeros(3), persistent=False)


def _model(layers, first=0):
    decoder = SimpleNamespace(
        layers=[
            SimpleNamespace(layer_number=first + i + 1, self_attention=SimpleNamespace(core_attention=_Core()))
            for i in range(layers)
        ]
    )
    return SimpleNamespace(decoder=decoder)


def test_refresh_reads_the_amax_of_each_layer_writes_the_scales_and_clears_the_amax():
    model = _model(2, first=2)  # a pipeline stage holding layers 2 and 3 of 4
    model.decoder.layers[1].self_attention.core_attention.kv_amax.copy_(torch.tensor([8.96, 4.48, 0.448]))
    state = kv.refresh(model, "running_max", kv.KvScaleState.start(4))
    assert torch.equal(state.scales[3], torch.tensor([8.96, 4.48, 0.448]) / 448)
    assert torch.equal(state.scales[:3], torch.ones(3, 3))
    core = model.decoder.layers[1].self_attention.core_attention
    assert torch.equal(core.kv_scale, state.scales[3]) and not core.kv_amax.any()
    assert kv.scale_metrics(state)["sync/kv_scale_q_max"] == 1.0


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_the_mapping_table_carries_the_scales_as_vllm_names_them_in_fp32(model_type):
    arch = ModelArch.from_hf_config(tiny_config(model_type))
    plain, with_kv = model_entries(arch), model_entries(arch, kv_scales=True)
    added = [e for e in with_kv if e.megatron.endswith("kv_scale")]
    assert len(added) == arch.num_layers and len(with_kv) == len(plain) + arch.num_layers
    entry = added[1]
    assert entry.megatron == KV_SCALE.format(i=1) and entry.fp32 and entry.tp_dim is None
    assert entry.hf == tuple(f"model.layers.1.self_attn.attn.{t}_scale" for t in "qkv")
    local = torch.tensor([0.5, 0.25, 0.125])
    assert torch.equal(from_hf(entry, arch, to_hf(entry, arch, local)), local)
    layout = {n: (shape, dtype) for n, shape, dtype in stream_layout(arch, FP8_KV, with_kv)}
    assert layout["model.layers.1.self_attn.attn.k_scale"] == ((1,), torch.float32)
    assert expected_tensors(arch, FP8_KV).keys() - expected_tensors(arch, PrecisionFlow("jetrl")).keys() == {
        f"model.layers.{i}.self_attn.attn.{t}_scale" for i in range(arch.num_layers) for t in "qkv"
    }
    scale = torch.tensor([3e-3, 2e-2, 1e-4])
    stream = dict(hf_tensors(arch, FP8_KV, added, lambda name: [scale]))
    assert {n: t.item() for n, t in stream.items()}["model.layers.0.self_attn.attn.v_scale"] == scale[2].item()
    assert all(t.dtype == torch.float32 for t in stream.values())


def _layers(arch, dtype="fp8", calculate=False, query_quant=True):
    return {
        f"model.layers.{i}.self_attn": SimpleNamespace(
            kv_cache_dtype=dtype,
            calculate_kv_scales=calculate,
            query_quant=object() if query_quant else None,
            **{f"_{t}_scale": torch.tensor(1.0) for t in "qkv"},
            _k_scale_cpu=torch.tensor(1.0),
            _v_scale_cpu=torch.tensor(1.0),
        )
        for i in range(arch.num_layers)
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_the_sync_writes_the_trainers_scales_into_vllms_attention_buffers_on_every_rank(tp):
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    state = bf16_state(arch)
    entries = model_entries(arch, kv_scales=True)
    scales = {e.megatron: torch.tensor([0.01, 0.02, 0.03]) * (i + 1) for i, e in enumerate(entries) if e.fp32}
    megatron = {e.megatron: scales.get(e.megatron) if e.fp32 else from_hf(e, arch, {n: state[n] for n in e.hf}) for e in entries}
    batch = dict(hf_tensors(arch, FP8_KV, entries, lambda name: [megatron[name]]))
    assert validate_weights(expected_tensors(arch, FP8_KV), batch, require_complete=True) == []
    for rank in range(tp):
        layers = _layers(arch)
        params = vllm_params(arch, FP8_KV, rank, tp) | kv_scale_params(layers)
        plan = copy_plan(arch, FP8_KV, params, rank, tp)
        assert apply_plan(arch, plan, params, batch, rank, tp) == []
        sync_scale_floats(layers)
        for prefix, layer in layers.items():
            want = batch[f"{prefix}.attn.k_scale"].item()
            assert layer._k_scale.item() == want and layer._k_scale_float == want and layer._k_scale_cpu.item() == want
            assert layer._q_scale.item() == batch[f"{prefix}.attn.q_scale"].item()


def test_a_scale_that_is_not_finite_and_positive_is_refused_before_anything_is_written():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    specs = expected_tensors(arch, FP8_KV)
    batch = {n: torch.full(shape, 0.5, dtype=torch.float32) for n, (shape, dtype) in specs.items() if n.endswith("_scale")}
    batch["model.layers.0.self_attn.attn.k_scale"] = torch.tensor([0.0])
    batch["model.layers.1.self_attn.attn.v_scale"] = torch.tensor([float("nan")])
    problems = validate_weights(specs, batch)
    assert "model.layers.0.self_attn.attn.k_scale: scales must be finite and positive" in problems
    assert "model.layers.1.self_attn.attn.v_scale: scales must be finite and positive" in problems


def test_the_engine_refuses_a_kv_cache_that_is_not_the_flows():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    assert kv_cache_problems(_layers(arch), FP8_KV, tile_patched=True) == []
    assert kv_cache_problems(_layers(arch, dtype="auto"), PrecisionFlow("jetrl"), tile_patched=False) == []
    said = "\n".join(kv_cache_problems(_layers(arch, dtype="auto"), FP8_KV, tile_patched=True))
    assert "KV cache dtype is 'auto', the flow's precision.kv_cache is 'fp8'" in said
    said = "\n".join(kv_cache_problems(_layers(arch), PrecisionFlow("jetrl"), tile_patched=False))
    assert "the flow's precision.kv_cache is 'bf16'" in said
    said = "\n".join(kv_cache_problems(_layers(arch, calculate=True), FP8_KV, tile_patched=True))
    assert "computes its own K/V scales" in said
    said = "\n".join(kv_cache_problems(_layers(arch, query_quant=False), FP8_KV, tile_patched=True))
    assert "does not quantize the query" in said
    assert "pick its kernel by the batch" in "\n".join(kv_cache_problems(_layers(arch), FP8_KV, tile_patched=False))
    engine = PrecisionFlow("bf16-train-fp8-rollout", kv_cache="fp8", kv_scales="engine")
    assert kv_cache_problems(_layers(arch, calculate=True), engine, tile_patched=False) == []
    assert issubclass(EngineConformanceError, RuntimeError)


def test_the_engine_starts_with_an_fp8_cache_and_the_flows_scale_owner(tmp_path):
    write_model_dir(tmp_path, tiny_config("qwen3"), FP8_KV)
    kwargs = llm_kwargs(tmp_path, FP8_KV)
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["calculate_kv_scales"] is False
    engine = PrecisionFlow("bf16-train-fp8-rollout", kv_cache="fp8", kv_scales="engine")
    assert llm_kwargs(tmp_path, engine)["calculate_kv_scales"] is True
    assert "kv_cache_dtype" not in llm_kwargs(tmp_path, PrecisionFlow("jetrl"))


def test_an_fp8_cache_holds_twice_the_sequences_of_a_bf16_one():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    assert kv_bytes_per_token(arch, 1, 1) * 2 == kv_bytes_per_token(arch, 1)
    assert kv_cache_need(arch, 8, 1000, 1, 1) * 2 == kv_cache_need(arch, 8, 1000)
    cache = 4 * 1024 * kv_bytes_per_token(arch)  # four BF16 sequences of 1000 tokens (in 16-token blocks)
    assert sequences_at_once(cache, arch, 64, 1000, 1, 1) == 2 * sequences_at_once(cache, arch, 64, 1000)


def test_the_flow_refuses_kv_settings_that_cannot_hold():
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        PrecisionFlow(kv_cache="fp16")
    with pytest.raises(ValueError, match="cannot know"):
        PrecisionFlow("jetrl", exact_logprobs=True, kv_cache="fp8", kv_scales="engine")
    with pytest.raises(ValueError, match="needs scales"):
        PrecisionFlow(kv_cache="fp8", kv_scales="none")
    assert FP8_KV.trainer_kv_scales and FP8_KV.kv_scale_policy == "running_max"
    assert PrecisionFlow(kv_cache="fp8").kv_scale_policy == "engine" and not PrecisionFlow(kv_cache="fp8").trainer_kv_scales


def _refresh_on_a_rank():
    """One rank of PP 2 x DP 2 over 4 layers: its stage's two layers, amax that differ by rank."""
    from megatron.core import parallel_state as ps

    stage, rank = ps.get_pipeline_model_parallel_rank(), torch.distributed.get_rank()
    model = _model(2, first=2 * stage)
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.core_attention.kv_amax.copy_(torch.tensor([1.0, 2.0, 3.0]) * (rank + 1) * (i + 1))
    state = kv.refresh(model, "amax", kv.KvScaleState.start(4))
    return state.scales, [layer.self_attention.core_attention.kv_scale.clone() for layer in model.decoder.layers]


def test_every_rank_decides_the_same_scales_from_the_largest_amax_of_any_rank():
    from actor_helpers import spawn
    from megatron.core import parallel_state  # noqa: F401 - the ranks import it

    results = spawn(4, 1, 2, _refresh_on_a_rank)
    scales = results[0][0]
    for got, _ in results:
        assert torch.equal(got, scales)
    # layer 2i+j lives on stage i and saw (rank + 1) * (j + 1) * [1, 2, 3] on the stage's ranks; the largest wins
    stage_ranks = {0: [], 1: []}
    for rank in range(4):
        stage_ranks[0 if rank in (0, 1) else 1].append(rank)
    for layer in range(4):
        stage, j = divmod(layer, 2)
        top = max(stage_ranks[stage]) + 1
        assert torch.allclose(scales[layer], torch.tensor([1.0, 2.0, 3.0]) * top * (j + 1) / 448)
    for rank, (_, written) in enumerate(results):
        stage = 0 if rank in stage_ranks[0] else 1
        assert torch.equal(torch.stack(written), scales[2 * stage : 2 * stage + 2])
