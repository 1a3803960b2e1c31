"""What a running vLLM 0.26.0 engine computes, read back at start-up against the precision flow (`VllmEngine`): the
kernel of every FP8 linear and its activation quantizer on a probe, the compile passes, under
`precision.exact_logprobs` the attention, cascade, glue, lm_head, model runner and TP all-reduce, and the KV cache's
dtype and scales. Any difference refuses the engine, naming it. Plain functions of the engine's objects, tested on CPU
with stand-ins (tests/unit/test_rollout_vllm.py, test_exact_logprobs_config.py, test_kv_scales.py)."""

from __future__ import annotations

import torch

from megatron_jetrl.fp8 import PrecisionFlow, quantize_blockwise

ALLOWED_KERNELS = ("DeepGemmFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")
"""Block-FP8 linear kernels whose activation quantizer is `QuantFP8` per 1x128 group (ours, byte for byte)."""
UNFUSED = {"fuse_norm_quant": False, "fuse_act_quant": False, "fuse_attn_quant": False, "fuse_allreduce_rms": False}


class EngineConformanceError(RuntimeError):
    """vLLM would not run the precision flow's forward (a kernel, switch or quantizer differs)."""


def fp8_kernels(model) -> dict[str, object]:
    """Module name -> the block-FP8 linear kernel object vLLM chose for it."""
    return {
        name: m.quant_method.fp8_linear
        for name, m in model.named_modules()
        if hasattr(getattr(m, "quant_method", None), "fp8_linear")
    }


def kernel_problems(kernels: dict[str, object], flow: PrecisionFlow) -> list[str]:
    """Every FP8 linear must run an allowed kernel whose activation quantizer is the CUDA `QuantFP8` op, with
    UE8M0 scales exactly when the flow's scale mode is ue8m0."""
    if flow.rollout_fp8 and not kernels:
        return ["no block-FP8 linear found in the vLLM model (was the checkpoint's quantization_config read?)"]
    problems = []
    for name, kernel in kernels.items():
        subs = [getattr(kernel, "base", None), getattr(kernel, "fallback", None)]
        for k in [s for s in subs if s is not None] or [kernel]:
            cls = type(k).__name__
            quant = getattr(k, "quant_fp8", None)
            if cls not in ALLOWED_KERNELS or not getattr(k, "apply_input_quant", True) or quant is None:
                problems.append(
                    f"{name}: kernel {cls} (allowed: {', '.join(ALLOWED_KERNELS)}; a kernel that quantizes "
                    "activations itself changes the bytes: set VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0)"
                )
                continue
            if bool(getattr(quant, "use_ue8m0", False)) != (flow.scale_mode == "ue8m0"):
                problems.append(
                    f"{name}: {cls} quantizes activations with use_ue8m0={quant.use_ue8m0} but the flow's "
                    f"scale_mode is {flow.scale_mode!r} (VLLM_USE_DEEP_GEMM_E8M0 must be "
                    f"{flow.vllm_env().get('VLLM_USE_DEEP_GEMM_E8M0')})"
                )
            method = getattr(getattr(quant, "_forward_method", None), "__name__", "forward_cuda")
            if method != "forward_cuda":
                problems.append(
                    f"{name}: the activation quantizer runs {method} (vLLM's torch version floors the scale "
                    "at 1/(448*512)): keep compilation_config custom_ops=['+quant_fp8']"
                )
    return problems[:20]


def pass_problems(pass_config) -> list[str]:
    """Compile passes that fuse quantization into other kernels (their own scale floor and rounding) must be off."""
    return [
        f"compilation pass {k}={getattr(pass_config, k, None)} (must be False: the fused kernel quantizes its own way)"
        for k in UNFUSED
        if getattr(pass_config, k, False)
    ]


def probe_tensor(device, dtype=torch.bfloat16, rows: int = 16, groups: int = 8, seed: int = 0) -> torch.Tensor:
    """Activations that test the quantizer's edges: a zero group, tiny groups, huge ones, rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * 128, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :128] = 0.0  # amax 0: the eps floor
    x[1, 128:256] *= 1e-12  # amax below eps * 448
    x[2, 256:384] = 1e-30
    x[3, 384:512] = torch.tensor([448.0, 1.0625, -1.1875, 2.125, 3.25, 0.01171875] * 22)[:128]  # s = 1: e4m3 ties
    x[4, 512:640] = 60000.0 * torch.sign(torch.randn(128, generator=g))
    return x.to(dtype).to(device)


def probe_problems(quant_fp8, flow: PrecisionFlow, x: torch.Tensor) -> list[str]:
    """vLLM's activation quantizer (the kernel's own `QuantFP8`) against `quantize_blockwise` on `x`."""
    q, s = quant_fp8(x)
    q_ref, s_ref = quantize_blockwise(x, (1, 128), flow.scale_mode, eps=flow.eps)
    rows, groups = q_ref.shape[0], s_ref.shape[1]
    s = s.float()[:rows, :groups] if s.shape[0] >= rows else s.float().t()[:rows, :groups]
    problems = []
    if not torch.equal(q[:rows].view(torch.uint8), q_ref.view(torch.uint8)):
        bad = (q[:rows].view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:3].tolist()
        problems.append(f"activation bytes differ from quantize_blockwise at (row, col) {bad}")
    if not torch.equal(s.contiguous(), s_ref.float()):
        bad = (s.contiguous() != s_ref.float()).nonzero()[:3].tolist()
        problems.append(f"activation scales differ from quantize_blockwise at (row, group) {bad}")
    return problems


def exact_problems(
    attention_impls: dict[str, object],
    one_split: bool,
    cascade_disabled: bool,
    glue: str,
    lm_head_method: str,
    v2_runner: bool = True,
    ordered_reduce: bool = True,
) -> list[str]:
    """Under `precision.exact_logprobs`, what in a running engine would compute other bytes than the actor's
    `rollout_kernels`: attention with more than one KV split or not FA3, cascade attention, vLLM's own RMSNorm/RoPE,
    an lm_head without the actor's GEMM, a model runner whose logprob kernel the actor does not call, and above TP 2 a
    TP all-reduce that does not add in rank order (`ordered_reduce` False)."""
    problems = []
    if not ordered_reduce:
        problems.append(
            "vLLM's TP all-reduce would add the partial sums in an order of its own (patches/vllm_0_26_0_ordered_all_reduce.py "
            "did not take effect before the engine started): let VllmEngine build the engine"
        )
    if not v2_runner:
        problems.append(
            "vLLM runs its V1 model runner, whose sampler computes logprobs with another kernel than the one "
            "the actor calls (the V2 runner's compute_token_logprobs): keep VLLM_USE_V2_MODEL_RUNNER=1"
        )
    if not one_split:
        problems.append(
            "vLLM's attention may split the KV cache (neither patches/vllm_0_26_0_one_split_attention.py nor "
            "VLLM_BATCH_INVARIANT=1 took effect before the attention layers were built): create the engine, "
            "or call rl.session.pin_vllm_environment, before anything imports vllm"
        )
    if not cascade_disabled:
        problems.append(
            "cascade attention is on (a shared prefix's attention merged from two kernels): build the engine "
            "with disable_cascade_attn=True"
        )
    for name, impl in list(attention_impls.items())[:3]:
        cls, version = type(impl).__name__, getattr(impl, "vllm_flash_attn_version", None)
        if cls != "FlashAttentionImpl" or version != 3:
            problems.append(
                f"{name}: attention {cls} (FlashAttention version {version}); the actor computes FlashAttention "
                "3's bytes: leave vLLM's default attention backend on Hopper"
            )
    if glue != "trainer":
        problems.append(
            f"rollout.glue resolved to {glue!r}: vLLM's own RMSNorm and RoPE round unlike the actor's; use "
            "rollout.glue=auto or trainer (a llama3 scaled RoPE cannot)"
        )
    if lm_head_method != "TrainerLMHeadMethod":
        problems.append(
            f"the lm_head runs {lm_head_method}, not the actor's lm_head GEMM (rollout.vllm_glue.use_trainer_lm_head "
            "takes an unquantized lm_head only)"
        )
    return problems


def check_numerics(model, flow: PrecisionFlow, pass_config, *, compiled: bool) -> dict:
    """Everything the flow pins, read back from the engine; raises EngineConformanceError naming what differs."""
    kernels = fp8_kernels(model)
    problems = kernel_problems(kernels, flow) if flow.rollout_fp8 else []
    if flow.rollout_fp8 and compiled:
        problems += pass_problems(pass_config)
    probed = 0
    if flow.rollout_fp8 and not problems:
        device = next(model.parameters()).device
        for kernel in {type(k).__name__: k for k in kernels.values()}.values():
            problems += probe_problems(kernel.quant_fp8, flow, probe_tensor(device))
            probed += 1
    if problems:
        raise EngineConformanceError("vLLM would not run the precision flow's forward:\n  - " + "\n  - ".join(problems))
    return {"kernels": sorted({type(k).__name__ for k in kernels.values()}), "fp8_linears": len(kernels), "probed": probed}


def kv_cache_problems(layers: dict[str, object], flow: PrecisionFlow, tile_patched: bool) -> list[str]:
    """What in a running engine's attention layers differs from the flow's KV cache: the cache dtype, who computes the
    scales, and under `exact_logprobs` with an FP8 cache, a query not quantized with the layer's scale, FA3's FP8 launch
    not pinned to one kernel (patches/vllm_0_26_0_fp8_attention_tile.py)."""
    problems = []
    fp8 = flow.kv_cache == "fp8"
    for name, layer in list(layers.items())[:3]:
        dtype = getattr(layer, "kv_cache_dtype", None)
        if str(dtype).startswith("fp8") != fp8:
            problems.append(f"{name}: vLLM's KV cache dtype is {dtype!r}, the flow's precision.kv_cache is {flow.kv_cache!r}")
            continue
        if not fp8:
            continue
        engine = bool(getattr(layer, "calculate_kv_scales", False))
        if engine and flow.kv_scale_policy != "engine":
            problems.append(
                f"{name}: vLLM computes its own K/V scales (calculate_kv_scales), the trainer's "
                f"({flow.kv_scale_policy}) would be overwritten: start the engine with calculate_kv_scales=False"
            )
        if flow.exact_logprobs and getattr(layer, "query_quant", None) is None:
            problems.append(
                f"{name}: vLLM's attention does not quantize the query with the layer's q scale (no query_quant), "
                "so its FP8 attention is not the actor's: use the FlashAttention 3 backend"
            )
    if fp8 and flow.exact_logprobs and not tile_patched:
        problems.append(
            "FA3's FP8 forward would pick its kernel by the batch (patches/vllm_0_26_0_fp8_attention_tile.py did not "
            "take effect before the engine started)"
        )
    return problems


def check_kv_cache(layers: dict[str, object], flow: PrecisionFlow) -> dict:
    """`kv_cache_problems` of a running engine; any refuses it."""
    tile = False
    if flow.exact_logprobs and flow.kv_cache == "fp8":
        from megatron_jetrl.patching import load_patch

        tile = load_patch("vllm_0_26_0_fp8_attention_tile").applied()
    problems = kv_cache_problems(layers, flow, tile)
    if problems:
        raise EngineConformanceError("vLLM's KV cache is not the flow's:\n  - " + "\n  - ".join(problems))
    return {"dtype": flow.kv_cache, "scales": flow.kv_scale_policy, "layers": len(layers)}
