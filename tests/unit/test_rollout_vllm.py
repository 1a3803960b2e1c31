"""The vLLM engine's parts that run without vLLM: environment, LLM/SamplingParams arguments, output
parsing, HF name -> vLLM parameter mapping and TP slicing, payloads."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from test_rollout_native import BF16, JETRL, bf16_state, live_stream, tiny_config

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout import SamplingParams
from megatron_jetrl.rollout.vllm_checks import (
    UNFUSED,
    EngineConformanceError,
    kernel_problems,
    pass_problems,
    probe_problems,
    probe_tensor,
)
from megatron_jetrl.rollout.vllm_engine import (
    VLLM_VERSION,
    engine_env,
    llm_kwargs,
    parse_output,
    pin_environment,
    sampling_kwargs,
    write_model_dir,
)
from megatron_jetrl.rollout.vllm_params import apply_plan, copy_plan, rank_piece, vllm_target


def test_vllm_is_not_imported_by_the_rollout_package():
    assert "vllm" not in sys.modules and VLLM_VERSION == "0.26.0"


def test_environment_is_pinned_before_import():
    assert engine_env(JETRL) == {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
    assert engine_env(PrecisionFlow("jetrl", scale_mode="ue8m0"))["VLLM_USE_DEEP_GEMM_E8M0"] == "1"
    assert engine_env(PrecisionFlow("bf16"), {"VLLM_USE_DEEP_GEMM": "0"}) == {"VLLM_USE_DEEP_GEMM": "0"}
    with pytest.raises(ValueError, match="re-quantize"):
        engine_env(JETRL, {"VLLM_USE_DEEP_GEMM_E8M0": "1"})
    environ = {}
    pin_environment(engine_env(JETRL), environ, modules={})
    assert environ["VLLM_USE_DEEP_GEMM_E8M0"] == "0" and environ["VLLM_DEEP_GEMM_WARMUP"] == "skip"
    with pytest.raises(RuntimeError, match="imported before"):
        pin_environment(engine_env(JETRL), {}, modules={"vllm": object()})
    pin_environment(engine_env(JETRL), dict(environ), modules={"vllm": object()})  # already agrees: fine


def test_llm_kwargs_colocated_dummy_engine_with_pinned_compilation(tmp_path):
    config = tiny_config("qwen3")
    write_model_dir(tmp_path, config, JETRL)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["quantization_config"] == JETRL.quantization_config() and written["architectures"] == ["Qwen3ForCausalLM"]
    kw = llm_kwargs(
        tmp_path, JETRL, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 30, seed=7, max_model_len=512, glue="vllm"
    )
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16" and kw["tensor_parallel_size"] == 2
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["load_format"] == "dummy"
    assert kw["enable_sleep_mode"] is True and kw["kv_cache_memory_bytes"] == 1 << 30 and kw["max_model_len"] == 512
    assert kw["logprobs_mode"] == "raw_logprobs" and kw["skip_tokenizer_init"] is True and kw["disable_custom_all_reduce"] is True
    assert kw["compilation_config"] == {
        "custom_ops": ["+quant_fp8"],
        "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False, "fuse_attn_quant": False, "fuse_allreduce_rms": False},
    }
    assert "compilation_config" not in llm_kwargs(tmp_path, JETRL, enforce_eager=True)
    assert "compilation_config" not in llm_kwargs(tmp_path, JETRL, enforce_eager=True, glue="trainer")
    with pytest.raises(ValueError, match="TP=4 does not divide num_key_value_heads=2"):
        llm_kwargs(tmp_path, JETRL, tensor_parallel_size=4)
    bf16_dir = write_model_dir(tmp_path / "bf16", config, PrecisionFlow("bf16"))
    kw = llm_kwargs(bf16_dir, PrecisionFlow("bf16"), glue="vllm")
    assert "quantization" not in kw and "compilation_config" not in kw


def test_sampling_kwargs_and_output_parsing():
    kw = sampling_kwargs(
        SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=33, stop=("</a>",), stop_token_ids=(2,)), 17, [9, 2]
    )
    assert kw == dict(
        n=4,
        temperature=0.7,
        top_p=0.9,
        max_tokens=33,
        stop=["</a>"],
        stop_token_ids=[2, 9],
        ignore_eos=False,
        logprobs=0,
        seed=17 * 1_000_003,
    )
    # vLLM seeds sample j with seed + j: the pool's consecutive request seeds must not share a sample's stream, and
    # sample j of a request gets the native engine's seed for it
    from megatron_jetrl.rollout.engine import request_seeds_for
    from megatron_jetrl.rollout.sampling import sample_seed

    sampling = SamplingParams(n=8, seed=5)
    seeds = request_seeds_for(sampling, 64)
    children = [(r, j, sampling_kwargs(sampling, r, [])["seed"] + j) for r in seeds for j in range(8)]
    assert len({c for _, _, c in children}) == 64 * 8 and all(c == sample_seed(r, j) for r, j, c in children)
    # GRPO steps: no prompt of one step shares a request seed with a prompt of another
    from megatron_jetrl.rollout.sampling import step_seed

    per_step = [request_seeds_for(SamplingParams(n=8, seed=step_seed(3, step)), 64) for step in range(200)]
    assert len({r for seeds in per_step for r in seeds}) == 200 * 64
    assert len({sample_seed(r, j) for seeds in per_step for r in seeds for j in range(8)}) == 200 * 64 * 8
    assert "stop_token_ids" not in sampling_kwargs(SamplingParams(ignore_eos=True), None, [9])
    assert "seed" not in sampling_kwargs(SamplingParams(), None) and "stop" not in sampling_kwargs(SamplingParams(), None)
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    out = SimpleNamespace(
        prompt_token_ids=[1, 2],
        outputs=[
            SimpleNamespace(
                token_ids=[5, 6],
                logprobs=[{5: lp(-0.5), 9: lp(-3.0)}, {6: lp(-0.25)}],
                finish_reason="stop",
                stop_reason=6,
                text="xy",
            )
        ],
    )
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
    assert vllm_target(arch, pre + "self_attn.v_proj.weight_scale_inv") == (
        pre + "self_attn.qkv_proj.weight_scale_inv",
        "v",
        0,
        6,
    )
    assert vllm_target(arch, pre + "self_attn.v_proj.bias", 1, 2) == (pre + "self_attn.qkv_proj.bias", "v", 0, 384)
    assert vllm_target(arch, pre + "mlp.up_proj.weight", 0, 2) == (pre + "mlp.gate_up_proj.weight", 1, 0, 256)
    assert vllm_target(arch, pre + "mlp.down_proj.weight_scale_inv") == (pre + "mlp.down_proj.weight_scale_inv", None, 1, 0)
    assert vllm_target(arch, pre + "input_layernorm.weight") == (pre + "input_layernorm.weight", None, None, 0)
    scale = torch.arange(8.0).view(2, 4)  # o_proj scales [ceil(256/128), ceil(512/128)]: row parallel slices K blocks
    assert torch.equal(rank_piece(arch, pre + "self_attn.o_proj.weight_scale_inv", scale, 1, 2), scale[:, 2:])
    q = torch.arange(512 * 3.0).view(512, 3)
    assert torch.equal(rank_piece(arch, pre + "self_attn.q_proj.weight", q, 1, 2), q[256:])


# ---- on-device sync into vLLM's parameters (a stand-in with vLLM 0.26's layout: fused qkv / gate_up, block scales,
# vocab rows padded to 64 and split by rank); the real layout is checked on the GPU (tests/gpu/test_vllm.py) -------


def vllm_params(arch, flow, tp_rank=0, tp=1, poison=float("nan")):
    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size // tp
    q, kv = arch.num_heads * hd // tp, arch.num_kv_heads * hd // tp
    fp8 = flow.rollout_fp8
    vocab = -(-arch.vocab_size // 64) * 64 // tp
    params = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        params["lm_head.weight"] = (vocab, h)
    for n in range(arch.num_layers):
        pre = f"model.layers.{n}."
        params |= {pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,)}
        if arch.qk_norm:
            params |= {pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,)}
        if arch.qkv_bias:
            params[pre + "self_attn.qkv_proj.bias"] = (q + 2 * kv,)
        for name, shape in {
            "self_attn.qkv_proj": (q + 2 * kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_up_proj": (2 * i, h),
            "mlp.down_proj": (h, i),
        }.items():
            params[pre + name + ".weight"] = shape
            if fp8:
                params[pre + name + ".weight_scale_inv"] = (-(-shape[0] // 128), -(-shape[1] // 128))
    out = {}
    for name, shape in params.items():
        quantized = fp8 and ("proj" in name and not name.endswith(".bias"))
        dtype = (torch.float32 if name.endswith("scale_inv") else torch.float8_e4m3fn) if quantized else torch.bfloat16
        out[name] = torch.full(shape, poison, dtype=torch.float32).to(dtype)
    return out


@pytest.mark.parametrize(
    "model_type, flow",
    [("qwen2", JETRL), ("qwen3", JETRL), ("llama", PrecisionFlow("bf16")), ("qwen3", PrecisionFlow("bf16-train-fp8-rollout"))],
)
def test_copy_plan_writes_every_vllm_parameter_with_the_trainers_bytes(model_type, flow):
    arch = ModelArch.from_hf_config(tiny_config(model_type))
    batch = dict(live_stream(arch, bf16_state(arch), flow))
    for tp in (1, 2):
        for rank in range(tp):
            params = vllm_params(arch, flow, rank, tp)
            plan = copy_plan(arch, flow, params, rank, tp)
            assert apply_plan(arch, plan, params, batch, rank, tp) == []
            for hf_name, slot in plan.items():
                piece = rank_piece(
                    arch,
                    hf_name,
                    batch[hf_name],
                    rank,
                    tp,
                    params[slot.param].shape[0] if "embed" in hf_name or "lm_head" in hf_name else None,
                )
                got = params[slot.param][slot.row : slot.row + slot.rows]
                assert torch.equal(got.view(torch.uint8), piece.contiguous().view(torch.uint8)), hf_name
            for name, t in params.items():  # nothing left unwritten but the vocabulary's padding rows
                real = t[: arch.vocab_size - rank * t.shape[0]] if ("embed" in name or "lm_head" in name) else t
                assert not real.float().isnan().any(), name


def test_copy_plan_refuses_a_relaid_out_or_uncovered_parameter():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    params = vllm_params(arch, JETRL)
    scale = "model.layers.1.self_attn.qkv_proj.weight_scale_inv"
    params[scale] = params[scale].t().contiguous()  # e.g. scales transposed for another kernel
    params["model.layers.0.self_attn.extra.weight"] = torch.zeros(4)
    params["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(2048, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(EngineConformanceError) as e:
        copy_plan(arch, JETRL, params)
    text = str(e.value)
    assert scale in text and "model.layers.0.self_attn.extra.weight: no tensor" in text and "writes 1024 of its 2048 rows" in text


def test_apply_plan_names_the_tensors_whose_bytes_did_not_arrive():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    batch = dict(live_stream(arch, bf16_state(arch), JETRL))
    params = vllm_params(arch, JETRL)
    plan = copy_plan(arch, JETRL, params)

    name = "model.layers.0.self_attn.o_proj.weight"
    real = params[plan[name].param]
    broken = dict(params)
    broken[plan[name].param] = real.clone()
    original_copy = torch.Tensor.copy_

    def copy(dst, src, *a, **k):  # a transfer that drops the last row of one tensor
        out = original_copy(dst, src, *a, **k)
        if dst.shape == real.shape and dst.data_ptr() == broken[plan[name].param].data_ptr():
            dst[-1].view(torch.uint8).fill_(0x7F)
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "copy_", copy)
        assert apply_plan(arch, plan, broken, batch) == [name]


# ---- numerics read back from the engine ----------------------------------------------------------------------


class FakeQuant:
    def __init__(self, use_ue8m0=False, floor=None, method="forward_cuda"):
        self.use_ue8m0, self.floor = use_ue8m0, floor
        self._forward_method = SimpleNamespace(__name__=method)

    def __call__(self, x):  # vLLM's layout: column-major scales (shape [M, G], strides (1, M))
        from megatron_jetrl.fp8 import quantize_blockwise

        flow = PrecisionFlow("jetrl", scale_mode="ue8m0" if self.use_ue8m0 else "fp32")
        if self.floor is None:
            q, s = quantize_blockwise(x, (1, 128), flow.scale_mode)
        else:  # vLLM's forward_native: scale floored at 1/(448*512) instead of amax at 1e-10
            g = x.float().view(x.shape[0], -1, 128)
            s = (g.abs().amax(-1) / 448).clamp(min=self.floor)
            q = (g / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape)
        return q, s.t().contiguous().t()


def kernel(name="DeepGemmFp8BlockScaledMMKernel", **quant):
    return type(name, (), {"quant_fp8": FakeQuant(**quant), "apply_input_quant": True})()


def test_kernel_and_pass_checks_name_what_differs():
    ue8m0 = PrecisionFlow("jetrl", scale_mode="ue8m0")
    assert kernel_problems({"l0.qkv": kernel()}, JETRL) == []
    assert kernel_problems({"l0.qkv": kernel(use_ue8m0=True)}, ue8m0) == []
    (msg,) = kernel_problems({"l0.qkv": kernel(use_ue8m0=True)}, JETRL)
    assert "l0.qkv" in msg and "VLLM_USE_DEEP_GEMM_E8M0 must be 0" in msg
    (msg,) = kernel_problems({"l1.down": kernel("FlashInferFp8BlockScaledMMKernel")}, JETRL)
    assert "FlashInferFp8BlockScaledMMKernel" in msg and "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0" in msg
    (msg,) = kernel_problems({"l1.down": kernel(method="forward_native")}, JETRL)
    assert "+quant_fp8" in msg
    assert "no block-FP8 linear" in kernel_problems({}, JETRL)[0]
    dyn = type("DynamicKernel", (), {"base": kernel(), "fallback": kernel("MarlinFp8Kernel")})()
    assert "MarlinFp8Kernel" in kernel_problems({"l2.o": dyn}, JETRL)[0]
    assert pass_problems(SimpleNamespace(fuse_norm_quant=False, fuse_act_quant=True)) == [
        "compilation pass fuse_act_quant=True (must be False: the fused kernel quantizes its own way)"
    ]


def test_probe_accepts_our_quantizer_and_catches_a_scale_floor():
    x = probe_tensor("cpu")
    assert probe_problems(FakeQuant(), JETRL, x) == []
    ue8m0 = PrecisionFlow("jetrl", scale_mode="ue8m0")
    assert probe_problems(FakeQuant(use_ue8m0=True), ue8m0, x) == []
    problems = probe_problems(FakeQuant(floor=1 / (448 * 512)), JETRL, x)
    assert any("activation scales differ" in p and "[1, 1]" in p for p in problems)


def test_config_refuses_vllm_settings_that_cannot_run():
    from megatron_jetrl.rl.config import ConfigError, load_config

    ok = load_config("configs/gpu_1p5b.yaml", ["rollout.engine=vllm", "rollout.tp=1"])
    assert ok.rollout.kv_cache_fraction == 0.5 and ok.rollout.max_model_len == 0
    assert ok.rollout.glue == "trainer"  # auto, resolved when the config loads (rl.resolve)
    for overrides, message in [
        (["rollout.engine=vllm", "rollout.tp=2"], r"rollout.tp=2 must divide the number of ranks parallel.tp \* pp \* dp = 1"),
        (["rollout.engine=vllm", "run.device=cpu"], "rollout.engine=vllm needs a GPU run, not run.device=cpu"),
        (["rollout.tp=2"], "rollout.tp=2 is for rollout.engine=vllm"),
        (["rollout.engine=vllm", "rollout.kv_cache_fraction=1.5"], r"rollout.kv_cache_fraction must be in \(0, 1\)"),
        (["rollout.engine=vllm", "rollout.max_model_len=32"], "rollout.max_model_len=32 must exceed rollout.max_new_tokens=64"),
        (["rollout.engine=vllm", "rollout.glue=mine"], "rollout.glue must be 'auto', 'vllm' or 'trainer', got 'mine'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("configs/gpu_1p5b.yaml", overrides)


def load_bench_vllm():
    """tools/bench/bench_vllm.py as a module (it is a script, not a package module)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_vllm", Path(__file__).resolve().parents[2] / "tools" / "bench" / "bench_vllm.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_variants_set_only_what_they_measure(tmp_path):
    bench = load_bench_vllm()
    write_model_dir(tmp_path, tiny_config("qwen3"), JETRL)
    assert bench.variant_settings("shipped", "jetrl") == ({}, True)
    extra, verify = bench.variant_settings("fused", "jetrl")
    assert not verify and "compilation_config" not in llm_kwargs(tmp_path, JETRL, **extra)  # vLLM's default passes
    assert llm_kwargs(tmp_path, JETRL)["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"  # shipped: our glue
    extra, verify = bench.variant_settings("vllm-glue", "jetrl")
    assert verify and llm_kwargs(tmp_path, JETRL, **extra)["compilation_config"]["pass_config"] == UNFUSED
    extra, verify = bench.variant_settings("triton-attn", "bf16")
    kw = llm_kwargs(tmp_path, JETRL, **extra)
    assert verify and kw["attention_config"] == {"backend": "TRITON_ATTN"} and kw["compilation_config"]["mode"] == "NONE"
    with pytest.raises(ValueError, match="applies to --mode jetrl only"):
        bench.variant_settings("fused", "bf16")
    extra, verify = bench.variant_settings("cutlass-gemm", "jetrl")  # an engine environment, checked against the flow's
    assert verify and engine_env(JETRL, extra["env"])["VLLM_USE_DEEP_GEMM"] == "0"
    with pytest.raises(ValueError, match="applies to --mode jetrl only"):
        bench.variant_settings("cutlass-gemm", "bf16")
    assert bench.variant_settings("triton-gemm", "jetrl") == ({"linear_backend": "triton", "fused_quant": False}, True)
    with pytest.raises(ValueError, match="applies to --mode jetrl only"):
        bench.variant_settings("triton-gemm", "bf16")
    with pytest.raises(ValueError, match="unknown --variant"):
        bench.variant_settings("fast", "jetrl")
    assert bench.variant_settings("unfused-quant", "jetrl") == ({"fused_quant": False}, True)  # same bytes: still checked
    with pytest.raises(ValueError, match="applies to --mode jetrl only"):
        bench.variant_settings("unfused-quant", "bf16")
    # unseeded: the shipped engine; its decode runs pass no seed, so the pool sends no per-request seeds
    assert bench.variant_settings("unseeded", "bf16") == ({}, True)
    assert bench.sampling_seed("unseeded") is None and bench.sampling_seed("shipped") == 1
    from megatron_jetrl.rollout.engine import SamplingParams, request_seeds_for

    assert request_seeds_for(SamplingParams(seed=bench.sampling_seed("unseeded")), 4) is None
    # the decode profile's categories (kernel names as CUPTI reports them in these engines)
    cat = bench.decode_category
    assert cat("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>") == "attention"
    assert cat("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 4096u>") == "GEMM FP8"
    assert cat("_quantize_1x128_kernel") == "act quant" and cat("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "GEMM BF16"
    assert cat("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>") == "norm" and cat("_rope_fwd") == "rope"
    assert cat("void vllm::act_and_mul_kernel<...>") == "SiLU*mul" and cat("something_new") == "other"
    assert cat("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "NCCL"  # rollout TP


def test_bench_vllm_at_rollout_tp_runs_under_torchrun_one_process_per_gpu(monkeypatch, capsys):
    """`--tp k` is one engine over k GPUs, one process each: refused, naming the torchrun line, in a process that
    torchrun did not start with k ranks (before anything is imported or started)."""
    bench = load_bench_vllm()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        bench.main(["--tp", "4"])
    assert (
        "--tp 4 runs one process per GPU of the engine: start it as torchrun --nproc-per-node 4 "
        "tools/bench/bench_vllm.py --tp 4 ... (this is 1 process(es))"
    ) in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        bench.main(["--tp", "4"])
    assert "(this is 2 process(es))" in capsys.readouterr().err


def test_bench_vllm_pins_its_attention_as_a_run_resolves_it():
    """`--exact-logprobs auto` is what a run config of that mode, rollout TP and cache resolves; `--pins` applies one
    exact-logprob pin alone, refused beside exact logprobs (which apply them all) and, for FA3's FP8 kernel choice,
    without an FP8 cache. Each pin names a patch that exists."""
    from pathlib import Path

    bench = load_bench_vllm()
    assert bench.attention_setting("jetrl", 1, "fp8", "auto", []) == (True, [])
    assert bench.attention_setting("jetrl", 2, "bf16", "auto", []) == (True, [])
    assert bench.attention_setting("jetrl", 4, "bf16", "auto", []) == (False, [])  # auto stays off above TP 2
    assert bench.attention_setting("bf16", 1, "bf16", "auto", []) == (False, [])
    assert bench.attention_setting("jetrl", 4, "bf16", "true", []) == (True, [])
    assert bench.attention_setting("jetrl", 1, "fp8", "false", ["one-split"]) == (False, ["one-split"])
    assert bench.attention_setting("jetrl", 1, "fp8", "false", ["fp8-tile"]) == (False, ["fp8-tile"])
    with pytest.raises(ValueError, match="exact logprobs apply them all; add --exact-logprobs false"):
        bench.attention_setting("jetrl", 1, "fp8", "auto", ["one-split"])
    with pytest.raises(ValueError, match="needs --kv-cache fp8"):
        bench.attention_setting("jetrl", 1, "bf16", "false", ["fp8-tile"])
    patches = Path(__file__).resolve().parents[2] / "patches"
    assert all((patches / f"{stem}.py").is_file() for stem in bench.PINS.values())
    assert [bench.attention_label(r) for r in ({"exact_logprobs": True}, {"pins": ["one-split"]}, {})] == [
        "exact", "one-split", "none"
    ]  # fmt: skip
    variants = ({"exact_logprobs": True, "variant": "unseeded"}, {"pins": ["one-split", "fp8-tile"], "variant": "shipped"})
    assert [bench.attention_label(r) for r in variants] == ["exact, unseeded", "one-split+fp8-tile"]  # a --kv table row each


def test_glue_auto_is_the_trainers_unless_the_rope_is_scaled():
    from megatron_jetrl.rollout.vllm_engine import resolve_glue

    qwen, llama = (ModelArch.from_hf_config(tiny_config(t)) for t in ("qwen3", "llama"))
    assert resolve_glue("auto", qwen) == "trainer"
    assert resolve_glue("auto", llama) == "vllm"  # llama3's scaled RoPE is another vLLM class
    assert resolve_glue("auto", qwen, spec="te") == "vllm"  # a TE actor's norms are TE's
    assert resolve_glue("vllm", qwen) == "vllm" and resolve_glue("trainer", qwen) == "trainer"
    with pytest.raises(ValueError, match="glue must be one of"):
        resolve_glue("mine", qwen)


def test_trainers_glue_in_a_graph_engine_runs_full_decode_graphs_without_torch_compile(tmp_path):
    write_model_dir(tmp_path, tiny_config("qwen3"), JETRL)
    compiled = llm_kwargs(tmp_path, JETRL, glue="vllm")["compilation_config"]
    assert compiled["pass_config"] == UNFUSED and "mode" not in compiled  # vLLM's glue: its compiled engine, unfused
    graphs = llm_kwargs(tmp_path, JETRL)["compilation_config"]  # auto: the trainer's glue
    assert graphs == {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["+quant_fp8"]}
    assert "compilation_config" not in llm_kwargs(tmp_path, JETRL, enforce_eager=True)
    assert llm_kwargs(tmp_path, BF16, glue="trainer")["compilation_config"]["mode"] == "NONE"


def test_decode_profile_differences_two_generates_into_one_decode_step(monkeypatch):
    """bench_vllm.decode_profile: prefill and the first token cancel between the 2-token and the N-token generate."""
    bench = load_bench_vllm()
    new_tokens = []

    class Engine:
        def generate(self, prompts, sampling):
            new_tokens.append(sampling.max_new_tokens)

    def kernels(run):  # prefill 5 ms of GEMM; each decode step 2 ms GEMM + 1 ms attention; 10 ms busy per step
        run()
        steps = new_tokens[-1] - 1
        return {"nvjet_gemm": 5.0 + 2.0 * steps, "flash_fwd": 1.0 * steps}, 10.0 * steps, [0.5 * steps, 0, 0, 1.0 + 0.25 * steps]

    monkeypatch.setattr(bench, "_kernels", kernels)
    monkeypatch.setattr(bench, "timed", lambda fn: (fn(), 0.004 * new_tokens[-1])[1])  # 4 ms per generated token
    p = bench.decode_profile(Engine(), [[1, 2]] * 3, steps=12)
    assert p["batch"] == 3 and p["steps"] == 10 and set(new_tokens) == {2, 12}
    assert p["wall_ms"] == pytest.approx(4.0) and p["busy_ms"] == pytest.approx(10.0) and p["kernel_ms"] == pytest.approx(3.0)
    assert p["categories"] == pytest.approx({"GEMM BF16": 2.0, "attention": 1.0})
    assert [name for name, _ in p["top"]] == ["nvjet_gemm", "flash_fwd"]
    assert p["idle_ms_by_gap_us"] == pytest.approx({"0-4": 0.5, "4-20": 0.0, "20-200": 0.0, ">200": 0.25})


def test_kernel_timeline_merges_overlaps_and_bins_the_idle_gaps():
    """bench_vllm.kernel_timeline: busy time merges overlapping kernels; each idle gap lands in its length's bin."""
    bench = load_bench_vllm()
    us = 1000
    ivs = [
        (0, 10 * us, "a"),
        (5 * us, 12 * us, "b"),
        (14 * us, 20 * us, "a"),  # overlap, then a 2 us gap
        (30 * us, 40 * us, "c"),
        (540 * us, 541 * us, "a"),
    ]  # a 10 us gap, then a 500 us gap
    by_name, busy_ms, gaps = bench.kernel_timeline(ivs)
    assert by_name == pytest.approx({"a": 0.017, "b": 0.007, "c": 0.010})
    assert busy_ms == pytest.approx(0.029)
    assert gaps == pytest.approx([0.002, 0.010, 0.0, 0.500])


def test_bench_counts_deep_gemm_kernels_where_vllm_keeps_them(monkeypatch, tmp_path):
    """bench_vllm.deep_gemm_cache_dir follows vLLM 0.26 (vllm/utils/deep_gemm.py): DG_JIT_CACHE_DIR if set, else
    $VLLM_CACHE_ROOT/deep_gemm, whose root defaults to $XDG_CACHE_HOME/vllm or ~/.cache/vllm (not DeepGEMM's own
    ~/.deep_gemm, where it finds 0 kernels, cold or warm)."""
    from pathlib import Path

    bench = load_bench_vllm()
    for var in ("DG_JIT_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bench.deep_gemm_cache_dir() == tmp_path / ".cache" / "vllm" / "deep_gemm"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert bench.deep_gemm_cache_dir() == Path("/x/vllm/deep_gemm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "~/v")
    assert bench.deep_gemm_cache_dir() == tmp_path / "v" / "deep_gemm"
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/dg")
    assert bench.deep_gemm_cache_dir() == Path("/dg")


def test_bench_profiles_at_the_runs_mean_context_and_counts_the_layers_linear_bytes():
    """bench_vllm: the profiled prompts default to the timed runs' mean decode context (centred on the profiled
    steps); a window past the engine's prompt + new tokens is refused; linear_GB counts the layers' 2-D tensors only."""
    bench = load_bench_vllm()
    errors = []

    def error(message):
        errors.append(message)
        raise SystemExit(2)

    assert bench.profile_context(512, 1024, 64, None, error) == 512 + 512 - 32
    assert bench.profile_context(256, 512, 64, 100, error) == 100
    for steps, context in ((64, 1000), (2, None), (64, 0)):
        with pytest.raises(SystemExit):
            bench.profile_context(512, 512, steps, context, error)
    assert "does not fit the engine's 512 + 512 tokens" in errors[0] and "at least 3" in errors[1]
    tensors = {
        "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 4, dtype=torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.zeros(1, 1),
        "model.layers.0.input_layernorm.weight": torch.zeros(4, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(16, 4, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(16, 4),
    }
    assert bench.linear_bytes(tensors) == 8 * 4 + 4


def test_bench_counts_the_sequences_the_kv_cache_holds_at_once():
    bench = load_bench_vllm()
    # 8200 tokens are 513 blocks of 16; vLLM keeps one block back
    assert bench.at_once((513 * 20 + 1, 16), 32, 8200) == 20
    assert bench.at_once((513 * 20, 16), 32, 8200) == 19
    assert bench.at_once((513 * 40 + 1, 16), 32, 8200) == 32  # at most the batch
    assert bench.at_once(None, 32, 8200) is None
