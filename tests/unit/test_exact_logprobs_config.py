"""`precision.exact_logprobs` on the CPU: the key, what it asks of vLLM, every refusal with its reason, and the start-up
read-back's verdicts (the GPU side: tests/gpu/test_exact_logprobs.py)."""

import pytest

from megatron_jetrl.actor.provider import ActorOptions
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.rl.config import ConfigError, load_config
from megatron_jetrl.rollout.vllm_engine import engine_env, exact_problems

GPU = ["configs/gpu_1p5b.yaml"]
ON = ["precision.exact_logprobs=true", "rollout.engine=vllm"]


def test_the_flow_asks_vllm_for_its_batch_invariant_mode_and_v2_runner():
    assert PrecisionFlow("jetrl").exact_logprobs is False
    env = engine_env(PrecisionFlow("jetrl", exact_logprobs=True))
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert engine_env(PrecisionFlow("bf16", exact_logprobs=True)) == {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert "VLLM_BATCH_INVARIANT" not in engine_env(PrecisionFlow("jetrl"))


def test_the_foil_and_non_booleans_are_refused():
    with pytest.raises(ValueError, match="two forwards by design"):
        PrecisionFlow("bf16-train-fp8-rollout", exact_logprobs=True)
    with pytest.raises(ValueError, match="exact_logprobs must be true or false"):
        PrecisionFlow("jetrl", exact_logprobs="yes")


def test_a_config_that_can_hold_it_loads():
    cfg = load_config(GPU, ON)
    assert cfg.precision.exact_logprobs and cfg.precision.vllm_env()["VLLM_BATCH_INVARIANT"] == "1"


@pytest.mark.parametrize("overrides,reason", [
    ([*ON, "parallel.pp=2"], r"precision.exact_logprobs runs at parallel.pp=1 \(got 2\)"),
    (["precision.exact_logprobs=true"], "needs rollout.engine=vllm"),
    ([*ON, "rollout.glue=vllm"], "trainer's RMSNorm and RoPE"),
    ([*ON, "model.batch_invariant=true", "precision.backend=emulated"], "model.batch_invariant=false"),
    ([*ON, "rollout.tp=2", "parallel.tp=1", "parallel.dp=2", "grpo.micro_batch_size=64"], "rollout.tp == parallel.tp"),
    ([*ON, "model.hf_config.rope_scaling={rope_type: llama3, factor: 8.0}"], "scaled RoPE"),
])
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
    assert exact_problems(good, True, True, "trainer", "UnquantizedEmbeddingMethod", True) == []
    problems = exact_problems({"layers.0.attn": TritonAttentionImpl()}, False, False, "vllm", "Fp8LinearMethod", False)
    text = "\n".join(problems)
    for words in ("V1 model runner", "batch-invariant mode is off", "cascade attention", "TritonAttentionImpl",
                  "rollout.glue resolved to 'vllm'", "Fp8LinearMethod"):
        assert words in text
    assert len(problems) == 6
