"""`precision.exact_logprobs` on the CPU: the key, what it asks of vLLM, every refusal with its reason, and the start-up
read-back's verdicts (the GPU side: tests/gpu/test_exact_logprobs.py)."""

import sys
import types

import pytest
import torch

from megatron_jetrl.actor.provider import ActorOptions
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.patching import load_patch
from megatron_jetrl.rl.config import ConfigError, load_config
from megatron_jetrl.rollout.vllm_checks import exact_problems
from megatron_jetrl.rollout.vllm_engine import engine_env, llm_kwargs

GPU = ["configs/gpu_1p5b.yaml"]
ON = ["precision.exact_logprobs=true", "rollout.engine=vllm"]


def test_an_fp8_rollout_pins_the_v2_runner_and_a_bf16_one_also_the_batch_invariant_mode():
    """An FP8 rollout's only BF16 GEMM is the lm_head, which the glue gives the actor's GEMM: vLLM's process-wide
    batch-invariant mode (aten overrides, NCCL and cuBLAS settings) stays off; BF16 linears need it."""
    assert PrecisionFlow("jetrl").exact_logprobs is False
    env = engine_env(PrecisionFlow("jetrl", exact_logprobs=True))
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and "VLLM_BATCH_INVARIANT" not in env
    assert env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert engine_env(PrecisionFlow("bf16", exact_logprobs=True)) == {
        "VLLM_BATCH_INVARIANT": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    }
    assert "VLLM_BATCH_INVARIANT" not in engine_env(PrecisionFlow("jetrl"))


def test_the_engine_is_built_without_cascade_attention(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, '
        '"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, '
        '"vocab_size": 512}'
    )
    assert llm_kwargs(tmp_path, PrecisionFlow("bf16", exact_logprobs=True))["disable_cascade_attn"] is True
    assert "disable_cascade_attn" not in llm_kwargs(tmp_path, PrecisionFlow("bf16"))


def get_scheduler_metadata(  # vllm_flash_attn 0.26.0's signature; returns what it was asked for
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
    qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
    page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0,
    pack_gqa=None, sm_margin=0,
):  # fmt: skip
    return {"batch_size": batch_size, "max_seqlen_q": max_seqlen_q, "qkv_dtype": qkv_dtype, "num_splits": num_splits}


class MetadataBuilder:
    """`FlashAttentionMetadataBuilder` as far as the patches touch it: `build` hands the launches `max_num_splits`
    (FA3's heuristics: 0) and the schedule the module's `get_scheduler_metadata` made ahead of time."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        schedule = sys.modules[PATCH_MODULE].get_scheduler_metadata(
            batch_size=4, max_seqlen_q=1, max_seqlen_k=4160, num_heads_q=32, num_heads_kv=8, headdim=128,
            cache_seqlens=None, qkv_dtype=common_attn_metadata, num_splits=0,
        )  # fmt: skip
        return types.SimpleNamespace(max_num_splits=0, scheduler_metadata=schedule)


PATCH_MODULE = "vllm.v1.attention.backends.flash_attn"


@pytest.fixture
def flash_attn_module(monkeypatch):
    """A stand-in for vLLM 0.26.0's `vllm.v1.attention.backends.flash_attn`: it reads `envs.VLLM_BATCH_INVARIANT`,
    launches `flash_attn_varlen_func` and makes the ahead-of-time schedule with `get_scheduler_metadata` in its
    metadata builder."""
    patch = load_patch("vllm_0_26_0_one_split_attention")
    assert patch.MODULE == load_patch("vllm_0_26_0_fp8_attention_tile").MODULE == PATCH_MODULE
    envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_USE_V2_MODEL_RUNNER=True)
    mod = types.ModuleType(patch.MODULE)
    mod.envs = envs
    mod.get_scheduler_metadata = get_scheduler_metadata
    mod.flash_attn_varlen_func = lambda q, k, v, max_seqlen_q, **kw: max_seqlen_q
    mod.FlashAttentionMetadataBuilder = type("FlashAttentionMetadataBuilder", (MetadataBuilder,), {})
    monkeypatch.setitem(sys.modules, patch.MODULE, mod)
    monkeypatch.setattr(load_patch("vllm_0_26_0_seeded_sampling"), "installed_version", lambda: "0.26.0")
    return patch, mod, envs


def test_the_one_split_patch_sets_batch_invariance_for_the_attention_backend_alone(flash_attn_module):
    patch, mod, envs = flash_attn_module
    assert not patch.applied()
    assert patch.apply() and patch.apply() and patch.applied()
    assert mod.envs.VLLM_BATCH_INVARIANT is True and envs.VLLM_BATCH_INVARIANT is False  # vllm.envs itself untouched
    assert mod.envs.VLLM_USE_V2_MODEL_RUNNER is True and mod.envs._envs is envs  # every other name is vLLM's
    assert (
        mod.get_scheduler_metadata is get_scheduler_metadata and mod.FlashAttentionMetadataBuilder.build is MetadataBuilder.build
    )


@pytest.mark.parametrize("one_split", [True, False])
def test_the_fp8_tile_patch_floors_the_launch_and_the_schedule_made_for_it(flash_attn_module, one_split):
    """With an FP8 query the launch and the schedule the builder makes ahead of time (when the one-split pin does not
    turn it off, e.g. the tile pin alone in tools/bench/bench_vllm.py --pins) both get `max_seqlen_q` at least the
    two-warpgroup floor: a schedule for another tile than the launch's would not be the launch's. BF16 passes through."""
    from megatron_jetrl.actor.rollout_kernels import fp8_attention_min_q

    split_patch, mod, _ = flash_attn_module
    tile = load_patch("vllm_0_26_0_fp8_attention_tile")
    assert not tile.applied()
    if one_split:
        split_patch.apply()
    assert tile.apply() and tile.applied() and tile.apply() and split_patch.applied() == one_split
    floor = fp8_attention_min_q(32, 8)
    assert floor > 1
    q8, q16, k = (
        torch.zeros(1, heads, 128, dtype=d) for heads, d in ((32, torch.float8_e4m3fn), (32, torch.bfloat16), (8, torch.bfloat16))
    )
    assert mod.flash_attn_varlen_func(q8, k, k, 1) == floor and mod.flash_attn_varlen_func(q8, k, k, 3 * floor) == 3 * floor
    assert mod.flash_attn_varlen_func(q16, k, k, 1) == 1
    fp8 = mod.FlashAttentionMetadataBuilder().build(0, torch.float8_e4m3fn)
    assert fp8.scheduler_metadata == {"batch_size": 4, "max_seqlen_q": floor, "qkv_dtype": torch.float8_e4m3fn, "num_splits": 0}
    assert mod.FlashAttentionMetadataBuilder().build(0, torch.bfloat16).scheduler_metadata["max_seqlen_q"] == 1
    assert mod.get_scheduler_metadata(4, 2 * floor, 9, 32, 8, 128, None, torch.float8_e4m3fn)["max_seqlen_q"] == 2 * floor


def test_the_one_split_patch_refuses_another_vllm(flash_attn_module, monkeypatch):
    patch, mod, envs = flash_attn_module
    sampling = load_patch("vllm_0_26_0_seeded_sampling")
    monkeypatch.setattr(sampling, "installed_version", lambda: "0.27.0")
    with pytest.raises(sampling.VllmVersionError, match=r"targets vllm==0.26.0 .* but vllm==0.27.0 is installed"):
        patch.apply()
    assert mod.envs is envs


def test_the_foil_and_non_booleans_are_refused():
    with pytest.raises(ValueError, match="two forwards by design"):
        PrecisionFlow("bf16-train-fp8-rollout", exact_logprobs=True)
    with pytest.raises(ValueError, match="exact_logprobs must be true or false"):
        PrecisionFlow("jetrl", exact_logprobs="yes")


def test_a_config_that_can_hold_it_loads():
    cfg = load_config(GPU, ON)
    assert cfg.precision.exact_logprobs and cfg.precision.vllm_env()["VLLM_USE_V2_MODEL_RUNNER"] == "1"


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (["precision.exact_logprobs=true"], "needs rollout.engine=vllm"),
        ([*ON, "rollout.glue=vllm"], "trainer's RMSNorm and RoPE"),
        ([*ON, "model.batch_invariant=true", "precision.backend=emulated"], "model.batch_invariant=false"),
        ([*ON, "rollout.tp=2", "parallel.tp=1", "parallel.dp=2", "grpo.micro_batch_size=64"], "rollout.tp == parallel.tp"),
        ([*ON, "model.hf_config.rope_scaling={rope_type: llama3, factor: 8.0}"], "scaled RoPE"),
    ],
)
def test_settings_that_break_equality_are_refused_naming_the_fix(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(GPU, overrides)


def test_actor_options_refuse_rollout_kernels_with_another_spec():
    with pytest.raises(ValueError, match="needs spec='local' without batch_invariant"):
        ActorOptions(rollout_kernels=True, batch_invariant=True)
    assert ActorOptions(rollout_kernels=True).rollout_kernels


class FlashAttentionImpl:
    vllm_flash_attn_version = 3


class TritonAttentionImpl:
    pass


def test_the_engine_read_back_names_each_difference():
    good = {"model.layers.0.self_attn.attn": FlashAttentionImpl()}
    assert exact_problems(good, True, True, "trainer", "TrainerLMHeadMethod", True) == []
    problems = exact_problems(
        {"layers.0.attn": TritonAttentionImpl()}, False, False, "vllm", "UnquantizedEmbeddingMethod", False, False
    )
    text = "\n".join(problems)
    for words in (
        "TP all-reduce would add the partial sums in an order of its own",
        "V1 model runner",
        "may split the KV cache",
        "cascade attention",
        "TritonAttentionImpl",
        "rollout.glue resolved to 'vllm'",
        "UnquantizedEmbeddingMethod, not the actor's lm_head GEMM",
    ):
        assert words in text
    assert len(problems) == 7


@pytest.mark.parametrize(
    "overrides,on",
    [
        ([], False),  # the native engine
        (["rollout.engine=vllm"], True),  # jetrl, vLLM, TP 1: on by default
        (["rollout.engine=vllm", "parallel.tp=2", "rollout.tp=2", "grpo.micro_batch_size=32"], True),
        (["rollout.engine=vllm", "precision.mode=bf16"], False),  # would need vLLM's process-wide mode
        (["rollout.engine=vllm", "precision.mode=bf16-train-fp8-rollout"], False),
        (["rollout.engine=vllm", "rollout.glue=vllm"], False),
        (["rollout.engine=vllm", "precision.exact_logprobs=false"], False),
        (["rollout.engine=vllm", "precision.exact_logprobs=auto"], True),
        (["rollout.engine=vllm", "precision.mode=bf16", "precision.exact_logprobs=true"], True),
    ],
)
def test_auto_the_default_turns_it_on_where_it_holds_and_the_flow_says_which(overrides, on):
    cfg = load_config(GPU, overrides)
    assert cfg.precision.exact_logprobs is on
    assert load_config(GPU, [*overrides, f"precision.exact_logprobs={str(on).lower()}"]).precision == cfg.precision


def test_pipeline_stages_take_it_and_auto_turns_it_on_there():
    """Under PP every layer runs the same kernels on the same rows and the stages pass BF16 activations unchanged
    (tests/gpu checks equality at PP 2; BENCHMARKS measures PP 4): `auto` turns it on at TP 1 and 2, as without PP."""
    assert load_config(GPU, [*ON, "parallel.pp=2"]).precision.exact_logprobs
    assert load_config(GPU, ["rollout.engine=vllm", "parallel.pp=2"]).precision.exact_logprobs
    assert not load_config(GPU, ["rollout.engine=vllm", "parallel.pp=2", "precision.mode=bf16"]).precision.exact_logprobs


def test_auto_stays_off_beyond_tp_2():
    eight_b = ["configs/gpu_8b_shapes.yaml", "rollout.engine=vllm", "grpo.micro_batch_size=32"]
    assert load_config(eight_b[:1], eight_b[1:] + ["parallel.tp=2", "rollout.tp=2"]).precision.exact_logprobs
    assert not load_config(eight_b[:1], eight_b[1:] + ["parallel.tp=4", "rollout.tp=4"]).precision.exact_logprobs


def test_auto_is_a_run_config_word_not_a_flow_value():
    with pytest.raises(ValueError, match=r"true or false \(a run config also takes auto, its default\), got 'auto'"):
        PrecisionFlow("jetrl", exact_logprobs="auto")
    with pytest.raises(ConfigError, match="got 'maybe'"):
        load_config(GPU, ["precision.exact_logprobs=maybe"])


def test_a_gpu_other_than_hopper_is_refused_naming_the_switch(monkeypatch):
    import torch

    from megatron_jetrl.rl.session import check_exact_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(ConfigError, match=r"this GPU is sm_100: set precision.exact_logprobs=false"):
        check_exact_device(PrecisionFlow("jetrl", exact_logprobs=True), torch.device("cuda", 0))
    check_exact_device(PrecisionFlow("jetrl"), torch.device("cuda", 0))  # off: any GPU
    check_exact_device(PrecisionFlow("jetrl", exact_logprobs=True), torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_exact_device(PrecisionFlow("jetrl", exact_logprobs=True), torch.device("cuda", 0))


def _rollout_linear_run(token_major: bool, fuse: bool, tied: bool = False):
    """`actor.rollout_kernels.rollout_linear` over `x[s, b, K]` with an exact GEMM (integers in FP64: any summation
    order gives the same sums), under megatron DDP's protocol where `fuse`: output, dX, the weight's gradient."""
    import torch

    from megatron_jetrl.actor.rollout_kernels import rollout_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (6, 3, 16), generator=g).double().requires_grad_(True)
    w = torch.randint(-4, 5, (10, 16), generator=g).double().requires_grad_(True)
    dy = torch.randint(-4, 5, (6, 3, 10), generator=g).double()
    w.main_grad = torch.ones(10, 16, dtype=torch.float64)
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = tied  # megatron's mark on a weight the embedding shares
    y = rollout_linear(x, w, None, lambda a, b: a @ b.t(), fuse=fuse, token_major=token_major)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, w.main_grad, w.grad_added_to_main_grad


def test_the_lm_heads_rows_run_sample_by_sample_and_its_weight_gradient_lands_in_main_grad():
    """The output layer under exact logprobs (`RolloutOutputLayer`: `token_major`) computes the logits `[s, b, V]` as a
    view of a `[b, s, V]`-contiguous tensor, so GPTModel's transpose of them copies nothing, with the same values and
    input gradient (contiguous: megatron's TP all-reduce reduces `x.contiguous()`); with `fuse` its weight gradient
    is added into the FP32 `main_grad` in the GEMM, megatron's placeholder returned."""
    import torch
    from torch import equal

    y, dx, dw, main, added = _rollout_linear_run(token_major=False, fuse=False)
    y_t, dx_t, dw_t, main_t, added_t = _rollout_linear_run(token_major=True, fuse=False)
    assert y_t.transpose(0, 1).is_contiguous() and not y.transpose(0, 1).is_contiguous()
    assert dx_t.is_contiguous() and dw is not None and not added and not added_t
    assert equal(y_t, y) and equal(dx_t, dx) and equal(dw_t, dw)
    _, dx_f, placeholder, main_f, added_f = _rollout_linear_run(token_major=True, fuse=True)
    assert added_f and placeholder.shape == dw.shape and equal(dx_f, dx)
    assert equal(main_f, main + dw)  # main_grad += dY^T X, in one GEMM
    assert equal(main_t, main)  # unfused: main_grad untouched (DDP's hook adds the gradient)
    _, _, tied, _, _ = _rollout_linear_run(token_major=True, fuse=True, tied=True)
    assert equal(tied, torch.zeros_like(tied))  # tied embeddings: .grad sums the lookup's part, DDP then adds it
