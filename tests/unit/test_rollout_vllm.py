"""The vLLM engine's parts that run without vLLM: environment, LLM/SamplingParams arguments, output
parsing, HF name -> vLLM parameter mapping and TP slicing, payloads."""

import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout import SamplingParams
from megatron_jetrl.rollout.vllm_engine import (
    VLLM_VERSION, WORKER_EXTENSION, engine_env, from_payload, llm_kwargs, parse_output, payload, pin_environment,
    rank_piece, sampling_kwargs, vllm_target,
)
from test_rollout_native import JETRL, bf16_state, live_stream, tiny_config, write_checkpoint


def test_vllm_is_not_imported_by_the_rollout_package():
    assert "vllm" not in sys.modules and VLLM_VERSION == "0.26.0"


def test_environment_is_pinned_before_import():
    assert engine_env(JETRL) == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert engine_env(PrecisionFlow("jetrl", scale_mode="ue8m0")) == {"VLLM_USE_DEEP_GEMM_E8M0": "1"}
    assert engine_env(PrecisionFlow("bf16"), {"VLLM_USE_DEEP_GEMM": "0"}) == {"VLLM_USE_DEEP_GEMM": "0"}
    with pytest.raises(ValueError, match="re-quantize"):
        engine_env(JETRL, {"VLLM_USE_DEEP_GEMM_E8M0": "1"})
    environ = {}
    pin_environment(engine_env(JETRL), environ, modules={})
    assert environ == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    with pytest.raises(RuntimeError, match="imported before"):
        pin_environment(engine_env(JETRL), {}, modules={"vllm": object()})
    pin_environment(engine_env(JETRL), dict(environ), modules={"vllm": object()})  # already agrees: fine


def test_llm_kwargs_from_an_fp8_checkpoint(tmp_path):
    config = tiny_config("qwen3")
    arch = ModelArch.from_hf_config(config)
    write_checkpoint(tmp_path, config, dict(live_stream(arch, bf16_state(arch), JETRL)), JETRL)
    kw = llm_kwargs(tmp_path, JETRL, tensor_parallel_size=2, gpu_memory_utilization=0.4, seed=7, max_model_len=512)
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16" and kw["tensor_parallel_size"] == 2
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.4 and kw["max_model_len"] == 512
    assert kw["worker_extension_cls"] == WORKER_EXTENSION and kw["logprobs_mode"] == "raw_logprobs"
    assert kw["skip_tokenizer_init"] is True and "tokenizer" not in kw
    with pytest.raises(ValueError, match="TP=4 does not divide num_key_value_heads=2"):
        llm_kwargs(tmp_path, JETRL, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="quantization_config.*bf16"):
        llm_kwargs(tmp_path, PrecisionFlow("bf16"))


def test_sampling_kwargs_and_output_parsing():
    kw = sampling_kwargs(SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=33, stop=("</a>",), stop_token_ids=(2,)), 17)
    assert kw == dict(n=4, temperature=0.7, top_p=0.9, max_tokens=33, stop=["</a>"], stop_token_ids=[2],
                      ignore_eos=False, logprobs=0, seed=17)
    assert "seed" not in sampling_kwargs(SamplingParams(), None) and "stop" not in sampling_kwargs(SamplingParams(), None)
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    out = SimpleNamespace(prompt_token_ids=[1, 2], outputs=[
        SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp(-0.5), 9: lp(-3.0)}, {6: lp(-0.25)}], finish_reason="stop", stop_reason=6, text="xy")])
    r = parse_output(out)
    assert r.prompt_token_ids == [1, 2]
    c = r.completions[0]
    assert (c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text) == ([5, 6], [-0.5, -0.25], "stop", 6, "xy")
    out.outputs[0].logprobs = None
    with pytest.raises(RuntimeError, match="logprobs=0"):
        parse_output(out)


def test_hf_names_map_to_vllm_fused_parameters_and_tp_slices():
    arch = ModelArch.from_hf_config(tiny_config("qwen2", num_attention_heads=4, num_key_value_heads=2, intermediate_size=512))
    pre = "model.layers.0."
    assert vllm_target(arch, pre + "self_attn.q_proj.weight") == (pre + "self_attn.qkv_proj.weight", "q", 0, 0)
    assert vllm_target(arch, pre + "self_attn.k_proj.weight") == (pre + "self_attn.qkv_proj.weight", "k", 0, 512)
    assert vllm_target(arch, pre + "self_attn.v_proj.weight_scale_inv") == (pre + "self_attn.qkv_proj.weight_scale_inv", "v", 0, 6)
    assert vllm_target(arch, pre + "self_attn.v_proj.bias", 1, 2) == (pre + "self_attn.qkv_proj.bias", "v", 0, 384)
    assert vllm_target(arch, pre + "mlp.up_proj.weight", 0, 2) == (pre + "mlp.gate_up_proj.weight", 1, 0, 256)
    assert vllm_target(arch, pre + "mlp.down_proj.weight_scale_inv") == (pre + "mlp.down_proj.weight_scale_inv", None, 1, 0)
    assert vllm_target(arch, pre + "input_layernorm.weight") == (pre + "input_layernorm.weight", None, None, 0)
    scale = torch.arange(8.0).view(2, 4)  # o_proj scales [ceil(256/128), ceil(512/128)]: row parallel slices K blocks
    assert torch.equal(rank_piece(arch, pre + "self_attn.o_proj.weight_scale_inv", scale, 1, 2), scale[:, 2:])
    q = torch.arange(512 * 3.0).view(512, 3)
    assert torch.equal(rank_piece(arch, pre + "self_attn.q_proj.weight", q, 1, 2), q[256:])


def test_payload_roundtrip_keeps_fp8_bytes():
    x = (torch.randn(128, 256) * 10).to(torch.float8_e4m3fn)
    flat, metas = payload([("a.weight", x), ("a.weight_scale_inv", torch.rand(1, 2))])
    assert flat.dtype == torch.uint8 and all(isinstance(m, tuple) for m in metas) and metas[0][1] == "float8_e4m3fn"
    (n, y), _ = from_payload(flat, metas)
    assert n == "a.weight" and torch.equal(y.view(torch.uint8), x.view(torch.uint8))
