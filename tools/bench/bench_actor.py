#!/usr/bin/env python3
"""Step time of the megatron-core actor, FP8 (`jetrl`) against BF16: a whole training step, or one layer.

    PYTHONPATH=/tmp/mcore:. python3 tools/bench/bench_actor.py [--layers auto] [--json PATH]    # whole step, one GPU
    PYTHONPATH=/tmp/mcore:. python3 tools/bench/bench_actor.py --layer [--shapes 4096x2 8192x1]  # one layer
    PYTHONPATH=. python3 tools/bench/bench_actor.py --tiny [--layer]                            # CPU smoke run

Whole step (default). What the trainer runs for one GRPO update on one GPU: `actor.provider.build_model` (GPTModel,
native spec, BF16 params) with Qwen3-8B-shaped layers (hidden 4096, intermediate 12288, 32/8 heads x 128, QK-norm,
vocabulary 151936), `actor.train_step.wrap_for_training` (megatron DDP + megatron's mixed-precision optimizer as
the preset sets it) and `actor.train_step.train_step` over `--micro-batches` micro-batches of
`--micro-batch x --seq` tokens with the GRPO policy loss (`grpo.loss.policy_loss`, the preset's clip/KL settings;
old = reference logprobs = the BF16 model's own, advantages random, the first quarter of each sequence masked as
prompt, which gets no logits as in `rl.train`: `extras["first"]`), ending in the optimizer step and the FP8 weight re-quantization. Every precision is built the way the
launcher builds it: `rl.config.load_config([--preset, configs/modes/<mode>.yaml], overrides)` and its
`precision` (the shipped `PrecisionFlow`), `optim` and `loss` sections; nothing is hand-tuned. Extra labelled
variants take overrides: `--modes bf16 jetrl jetrl+precision.backend=cublaslt`. Also timed: the forward-only
logprob pass over the same rows (`--logprob-micro-batch`), what a step's old-policy and reference passes run.

Attention is what a run of the variant has: with `precision.exact_logprobs` (jetrl's default at TP 1 with vLLM) the
engine's FA3 kernels (`ActorOptions(rollout_kernels=True)`: needs the vLLM kit; `--override
precision.exact_logprobs=false` without it), and with `precision.kv_cache=fp8` FA3's FP8 attention at scales decided
from one logprob pass's amax, as a run's first sync decides them: `--modes bf16 jetrl jetrl+precision.kv_cache=fp8`
measures what the FP8 attention costs the update and the logprob pass.

Layers: `--layers auto` (default) fits as many Qwen3-8B layers as the memory budget allows for every variant
(`--mem-gib`, default: all of the device's free memory, 10% kept back): it measures the peak memory of one step
with 1 and 2 layers per variant (fixed part + per layer) and takes the smallest fit, at most the model's 36. The
same layer count serves every variant. Give two or more counts (`--layers 4 auto`) to also get the step time
extrapolated linearly to the full 36 layers. An out-of-memory in the timed runs retries with 20% fewer layers.

Checks before timing: every variant gets the BF16 variant's initial weights (copied through the CPU); its
logprobs of the first micro-batch (centered per sequence) must be within a relative error of 0.5 of the BF16
ones (FP8 noise is ~0.05-0.2, a wrong GEMM ~1), and the first step must be finite and taken.
Timing: wall clock of `train_step` between CUDA syncs, median over `--steps` after `--warmup` steps (the first
compiles DeepGEMM/Triton kernels and allocates the Adam state). A variant with `rollout.offload` (`--modes bf16 jetrl
jetrl+rollout.offload=optimizer`) also times what that costs a GRPO step: its state's release and copy back
(`actor.offload`), with the GiB freed, in a table of its own.

One layer (`--layer`): one megatron `TransformerLayer` of the local spec as `build_model` builds it
(`actor.provider.layer_spec(arch, flow, "local", 1)`, `actor.provider.transformer_config`), input
`[seq, micro_batch, hidden]` BF16; its core attention (`SDPAttention`: RoPE, then torch SDPA) applies RoPE. Each
variant gets the same weights; FP8 weights carry an FP32 `main_grad`, as megatron's DDP gives them, and WGrad
accumulates into it (BF16 linears leave `.grad`, which DDP would add into its buffer afterwards). Variants:
  bf16                    megatron's plain ColumnParallel/RowParallel linears (the bf16 preset)
  jetrl                   the shipped jetrl preset flow
  bf16/eager, jetrl/eager the same with `ActorOptions(fused=False)`: RMSNorm, RoPE and BF16 SwiGLU as eager torch ops
  jetrl/cublaslt          FP8 linears on cuBLASLt, check_finite off; weight FP8 bytes cached (later micro-batches)
  jetrl/cublaslt+requant  the same, re-quantizing all four weights every iteration (one micro-batch per step)
  jetrl/cublaslt+finite   check_finite="sync" (one host sync per quantization)
  jetrl/triton            FP8 linears on the Triton GEMM, check_finite off
  jetrl/swiglu-fused      the jetrl flow with d[gate | up] made and quantized by one CUDA kernel in fc2's backward
                          (`kernels.QUANT_CFG["swiglu_bwd"]["mode"] = "cuda"`); jetrl/swiglu-split: the two kernels
Times: `triton.testing.do_bench` medians (ms) of the forward with autograd recording and of forward+backward;
backward = the difference. Also: the host time to issue one fwd+bwd (`host_issue_ms`: where it nears the GPU
time, the GPU idles between kernels), ||y - y_bf16|| / ||y_bf16||, the peak memory, and with `--profile` the GPU
kernel time per fwd+bwd by category (`torch.profiler`); `--step-profile` does the same for one whole step.

Without a CUDA GPU (and without --tiny): exit 2 with one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench import common  # noqa: E402

QWEN3_8B = dict(common.QWEN3_8B, num_hidden_layers=1)
TINY = dict(common.TINY, num_hidden_layers=1)

VARIANTS = {  # one-layer variants: name -> (precision mode preset, PrecisionFlow changes on top of it)
    "bf16": ("bf16", {}),
    "jetrl": ("jetrl", {}),
    "bf16/eager": ("bf16", {}),  # /eager: ActorOptions(fused=False), megatron's glue as eager torch ops
    "jetrl/eager": ("jetrl", {}),
    "jetrl/cublaslt": ("jetrl", dict(backend="cublaslt", check_finite="off")),
    "jetrl/cublaslt+requant": ("jetrl", dict(backend="cublaslt", check_finite="off")),
    "jetrl/cublaslt+finite": ("jetrl", dict(backend="cublaslt", check_finite="sync")),
    "jetrl/triton": ("jetrl", dict(backend="triton", check_finite="off")),
    "jetrl/swiglu-fused": ("jetrl", {}),  # kernels.QUANT_CFG["swiglu_bwd"]["mode"] = "cuda" for this variant
    "jetrl/swiglu-split": ("jetrl", {}),  # ... = "split"
    "jetrl/emulated": ("jetrl", dict(backend="emulated", check_finite="off")),
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PRESET = os.path.join(REPO, "configs", "models", "qwen3-8b-base.yaml")


def mode_file(mode: str) -> str:
    path = os.path.join(REPO, "configs", "modes", f"{mode}.yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "configs", "modes")) if f.endswith(".yaml"))
        print(f"error: no precision mode preset {path}; known modes: {known}", file=sys.stderr)
        raise SystemExit(2)
    return path


def load_preset(mode: str, preset: str = DEFAULT_PRESET, overrides=()):
    """The JetRLConfig the launcher builds from `preset` + configs/modes/<mode>.yaml (+ overrides), at TP 1 (and rollout TP 1)."""
    from megatron_jetrl.rl.config import load_config

    return load_config([preset, mode_file(mode)], ["parallel.tp=1", "rollout.tp=1", *overrides])


def variant_flow(name: str):
    """The PrecisionFlow of a one-layer variant: its mode preset's flow plus the variant's changes."""
    from megatron_jetrl.fp8 import PrecisionFlow

    mode, changes = VARIANTS[name]
    flow = load_preset(mode).precision
    return PrecisionFlow.from_dict({**flow.to_dict(), **changes}) if changes else flow


def one_rank(arch, seq: int):
    """This process as megatron's only rank (TP 1, PP 1); `arch` with room for `seq` positions."""
    import dataclasses

    from megatron_jetrl.actor.parallel import init_parallel

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    init_parallel(tp=1, pp=1)
    return dataclasses.replace(arch, max_position_embeddings=max(seq, arch.max_position_embeddings))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_layer(arch, flow, dtype, fused: bool = True):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_jetrl.actor.provider import ActorOptions, layer_spec, transformer_config

    config = transformer_config(arch, flow, tp=1, pp=1, options=ActorOptions(params_dtype=dtype, fused=fused))
    spec = layer_spec(arch, flow, "local", 1, fused=fused).layer_specs[0]  # the decoder's layer, as build_model makes it
    layer = build_module(spec, config=config, layer_number=1)
    # the native RMSNorm weights are made on the CPU; megatron's get_model() moves modules with .cuda()
    return layer.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else layer


def fp8_modules(layer):
    from megatron_jetrl.actor.fp8_layers import _FP8Weight

    return [m for m in layer.modules() if isinstance(m, _FP8Weight)]


def bench(fn, device, rep_ms: int, grad_to_none=None):
    """Median ms: triton's do_bench on GPU (CUDA events), two host-timed calls on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


CATEGORIES = (  # kernel-name substrings -> category (first match wins)
    ("optimizer (Adam, grad norm)", ("adam", "multi_tensor_apply", "normtwo")),
    ("logprobs (Inductor)", ("_exp_", "amax")),  # actor.logprobs' row kernels (RMSNorm's backward says "expand")
    (
        "fused glue (Triton, Inductor)",
        ("triton_poi_", "triton_per_", "triton_red_", "_rms_", "_rope"),
    ),  # actor.fused, megatron's SwiGLU
    (
        "quantize",
        ("_quant", "quant_tile", "swiglu_bwd_tile"),
    ),  # the Triton quantizers and the CUDA tile kernels (fp8/cuda_tiles.py)
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "_gemm_tma", "_gemm_ptr")),
    ("attention core", ("flash", "fmha", "attention", "softmax")),
    ("copy/transpose/cat", ("copy", "transpose", "cat", "memcpy", "memset")),
)


def host_issue_ms(fn, params, reps: int = 5) -> float:
    """Median host time to issue one `fn()` into an idle GPU queue (no sync inside): the Python, megatron and launch
    cost of a pass. Where it nears the GPU time, the GPU waits for the host (idle between kernels)."""
    times = []
    for _ in range(reps):
        for t in params:
            t.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def host_profile(fn, top: int, label: str) -> list[dict]:
    """One `fn()` under cProfile: its `top` costliest functions by self time (ms), printed under `label` and returned."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(
        (
            {"function": pstats.func_std_string(f), "calls": nc, "self_ms": tt * 1e3, "cumulative_ms": ct * 1e3}
            for f, (_, nc, tt, ct, _) in stats.stats.items()
        ),
        key=lambda r: -r["self_ms"],
    )[:top]
    print(f"  host profile {label}: {stats.total_tt * 1e3:.1f} ms under cProfile; self ms, calls, function:")
    for r in rows:
        print(f"    {r['self_ms']:9.2f} {r['calls']:7d}  {r['function'][:150]}")
    return rows


def profile_step(fn, params, iters: int = 3) -> dict:
    """GPU kernel time of one `fn()` (mean of `iters`), by category, the top kernels, and every kernel with its
    time and calls per `fn()` (`kernels`, for the JSON) (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            for t in params:
                t.grad = None
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    calls: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda:  # kernels (CUPTI events)
            us = ev.device_time_total if str(ev.device_type).endswith("CUDA") else 0.0
        else:  # CPU dry run: aten ops' own time
            us = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0.0
        if us:
            kernels[ev.key] = kernels.get(ev.key, 0.0) + us / 1e3 / iters
            calls[ev.key] = calls.get(ev.key, 0) + ev.count / iters
    cats: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "elementwise/norm/other")
        cats[cat] = cats.get(cat, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    every = [(name, round(ms, 4), calls[name]) for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])]
    return {"total_ms": sum(kernels.values()), "categories": cats, "top": top, "kernels": every}


def print_profiles(rows, title: str) -> None:
    """The rows' `profile`s as one table of kernel time by category, then each row's top kernels."""
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return
    cats = sorted({c for r in prof for c in r["profile"]["categories"]})
    print(f"\n{title}")
    print("| variant | " + " | ".join(cats) + " | sum of kernels |")
    print("|---|" + "---|" * (len(cats) + 1))
    for r in prof:
        c = r["profile"]["categories"]
        print(f"| {r['variant']} | " + " | ".join(f"{c.get(k, 0.0):.2f}" for k in cats) + f" | {r['profile']['total_ms']:.2f} |")
    for r in prof:
        print(f"top kernels {r['variant']}: " + "; ".join(f"{n[:60]} {ms:.2f}" for n, ms in r["profile"]["top"][:16]))


def layer_main(a):
    """The one-layer benchmark (`--layer`)."""
    cuda = torch.cuda.is_available()
    cfg = TINY if a.tiny else QWEN3_8B
    if a.tiny:
        a.shapes = ["64x2"]
        if not cuda:
            a.variants = ["bf16", "jetrl/emulated"]
            a.profile = ["bf16", "jetrl/emulated"]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))

    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"error: unknown --variants {bad}; known: {list(VARIANTS)}")

    init_parallel(tp=1, pp=1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArch.from_hf_config(cfg)
    print(
        f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}; layer hidden {arch.hidden_size}, "
        f"ffn {arch.intermediate_size}, heads {arch.num_heads}/{arch.num_kv_heads}x{arch.head_dim}",
        flush=True,
    )
    torch.manual_seed(0)
    ref_state = build_layer(arch, PrecisionFlow("bf16"), dtype).state_dict()
    ref_state = {k: v.detach().clone() for k, v in ref_state.items() if v is not None and isinstance(v, torch.Tensor)}
    rows = []
    for shape in a.shapes:
        seq, mb = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(1)
        x0 = torch.randn(seq, mb, arch.hidden_size, generator=g, device=device, dtype=dtype)
        dy = torch.randn(seq, mb, arch.hidden_size, generator=g, device=device, dtype=dtype) * 1e-2
        y_ref = None
        bases = {}  # the BF16 row each variant is compared with: bf16, or bf16/eager for the /eager variants
        from megatron_jetrl.fp8 import kernels

        shipped_swiglu = kernels.QUANT_CFG["swiglu_bwd"]["mode"]
        for name in a.variants:
            flow = variant_flow(name)
            swiglu = {"jetrl/swiglu-fused": "cuda", "jetrl/swiglu-split": "split"}.get(name, shipped_swiglu)
            kernels.QUANT_CFG["swiglu_bwd"] = dict(mode=swiglu)
            layer = build_layer(arch, flow, dtype, fused=not name.endswith("/eager"))
            missing, unexpected = layer.load_state_dict(ref_state, strict=False)
            if [m for m in missing if not m.endswith("_extra_state")] or unexpected:
                raise RuntimeError(f"{name}: state mismatch {missing} {unexpected}")
            x = x0.clone().requires_grad_(True)
            mods = fp8_modules(layer)
            for m in mods:  # the FP32 gradient buffer megatron's DDP gives every weight: FP8 WGrad accumulates into it
                m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
            requant = name.endswith("+requant")

            def fwd():
                if requant:
                    for m in mods:
                        m._fp8_cache = None
                return layer(x, attention_mask=None)[0]

            def fwd_bwd():
                fwd().backward(dy)

            params = [x] + list(layer.parameters())
            with torch.no_grad():
                y = layer(x, attention_mask=None)[0].float()
            finite = bool(torch.isfinite(y).all())
            if name == "bf16":
                y_ref = y
            err = float((y - y_ref).detach().norm() / y_ref.detach().norm()) if y_ref is not None else float("nan")
            del y
            fwd_bwd()  # compile/warm
            for t in params:
                t.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t_fwd = bench(lambda: fwd(), device, a.rep_ms)
            t_all = bench(fwd_bwd, device, a.rep_ms, grad_to_none=params)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            row = dict(
                shape=shape,
                tokens=seq * mb,
                variant=name,
                fwd_ms=t_fwd,
                fwd_bwd_ms=t_all,
                bwd_ms=t_all - t_fwd,
                rel_err_vs_bf16=err,
                finite=finite,
                peak_gib=peak,
                fp8_linears=len(mods),
                host_ms=host_issue_ms(fwd_bwd, params),
            )
            if name in ("bf16", "bf16/eager"):
                bases[name] = row
            base = bases.get("bf16/eager" if name.endswith("/eager") else "bf16")
            row["speedup_fwd_bwd"] = base["fwd_bwd_ms"] / t_all if base else float("nan")
            row["speedup_fwd"] = base["fwd_ms"] / t_fwd if base else float("nan")
            row["speedup_bwd"] = base["bwd_ms"] / row["bwd_ms"] if base else float("nan")
            if name in a.profile and shape == a.shapes[-1]:
                try:
                    row["profile"] = profile_step(fwd_bwd, params)
                except Exception as e:  # noqa: BLE001 - the timings above stand without it
                    row["profile_error"] = f"{type(e).__name__}: {e}"
                    print("profile failed:", row["profile_error"], flush=True)
            rows.append(row)
            print(
                f"{shape:8s} {name:24s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms  bwd {t_all - t_fwd:8.3f} ms  host {row['host_ms']:7.3f} ms  "
                f"x{row['speedup_fwd_bwd']:.3f}  err {err:.3g}  finite {finite}  peak {peak:.1f} GiB",
                flush=True,
            )
            del layer, x, mods, params
            if cuda:
                torch.cuda.empty_cache()
    destroy_parallel()
    print(
        "\n| tokens (seq x mb) | variant | fwd ms | bwd ms | fwd+bwd ms | host ms per fwd+bwd | vs BF16 fwd / bwd / fwd+bwd | rel. err vs BF16 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} ({r['shape']}) | {r['variant']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{r['speedup_fwd']:.2f}x / {r['speedup_bwd']:.2f}x / {r['speedup_fwd_bwd']:.2f}x | {r['rel_err_vs_bf16']:.3g} |"
        )
    print_profiles(rows, f"GPU kernel time per fwd+bwd (torch.profiler, ms), {a.shapes[-1]}:")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "rows": rows,
                },
                f,
                indent=1,
            )


# ---- the whole actor training step ------------------------------------------------------------------------

STEP_TARGET = 1.3


def parse_modes(entries):
    """`MODE[+section.key=value...]` -> (label, mode, overrides); the bf16 baseline first (added if missing)."""
    out = []
    for e in entries:
        mode, *ov = e.split("+")
        bad = [o for o in ov if "=" not in o or "." not in o.split("=", 1)[0]]
        if bad:
            print(f"error: --modes entry {e!r}: overrides are section.key=value joined by '+', got {bad}", file=sys.stderr)
            raise SystemExit(2)
        mode_file(mode)
        out.append((e, mode, ov))
    if not any(label == "bf16" for label, _, _ in out):
        out.insert(0, ("bf16", "bf16", []))
    out.sort(key=lambda v: v[0] != "bf16")
    return out


def _gc():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepRun:
    """One variant's actor at `layers` layers: model, DDP, optimizer, and the data of a step."""

    def __init__(self, label, cfg, arch, layers, device, state=None):
        import dataclasses

        from megatron_jetrl.actor.fp8_layers import unwrap
        from megatron_jetrl.actor.provider import build_model
        from megatron_jetrl.actor.train_step import wrap_for_training
        from megatron_jetrl.rl.session import actor_options

        self.label, self.cfg, self.flow = label, cfg, cfg.precision
        self.arch = dataclasses.replace(arch, num_layers=layers)
        cuda = device.type == "cuda"
        optim = cfg.optim if cuda else dataclasses.replace(cfg.optim, bf16=False, distributed=False)  # CPU: FP32 params
        release = (
            cfg.bf16_linears_released() and optim.bf16 and not optim.distributed
        )  # model.bf16_linear_weights, as a run resolves it
        self.options = dataclasses.replace(  # as a run of `cfg` builds its actor, with the CPU's FP32 params
            actor_options(cfg),
            params_dtype=torch.bfloat16 if optim.bf16 else torch.float32,
            max_sequence_length=max(self.arch.max_position_embeddings, 1),
            bf16_linear_weights="release" if release else "keep",
        )
        self.optim = optim
        torch.manual_seed(1234)
        model = build_model(self.arch, self.flow, self.options)
        cores = [type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")]
        self.core_attention = cores[0] if cores else "?"
        if state is not None:
            missing, unexpected = model.load_state_dict(state, strict=False)
            missing = [m for m in missing if not m.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(
                    f"{label}: the BF16 weights do not fit this model: missing {missing[:4]}, unexpected {unexpected[:4]}"
                )
        self.unwrap = unwrap
        self.model = model
        self.ddp, self.optimizer = wrap_for_training(model, optim)

    def set_kv_scales(self, tokens, mb) -> bool:
        """With an FP8 KV cache: one logprob pass at scale 1.0, then every layer's scales from its amax (`rl.kv_scales`,
        policy amax), as a run's first sync decides them. False without an FP8 cache."""
        from megatron_jetrl.rl import kv_scales

        if not kv_scales.attention_modules(self.ddp):
            return False
        with torch.no_grad():
            self.logprobs(tokens, mb)
        kv_scales.refresh(self.ddp, "amax", kv_scales.KvScaleState.start(self.arch.num_layers))
        return True

    def cpu_state(self):
        sd = self.unwrap(self.ddp).state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def logprobs(self, tokens, mb):
        from megatron_jetrl.actor.logprobs import compute_logprobs

        return compute_logprobs(self.ddp, tokens, vocab_size=self.arch.vocab_size, micro_batch_size=mb)

    def step(self, tokens, extras, mb):
        from megatron_jetrl.actor.train_step import train_step
        from megatron_jetrl.grpo.loss import check_mask, policy_loss

        loss_cfg = self.cfg.loss

        check_mask(extras["mask"], loss_cfg.agg, rows_per_loss=mb)

        def loss_fn(logprobs, ex):  # as rl.train.update_policy builds it
            return policy_loss(
                logprobs,
                ex["old"],
                ex["adv"],
                ex["mask"],
                cfg=loss_cfg,
                ref_logprobs=ex.get("ref"),
                rollout_logprobs=ex["rollout"],
                checked=True,
            )

        return train_step(
            self.ddp, self.optimizer, tokens, loss_fn, vocab_size=self.arch.vocab_size, micro_batch_size=mb, extras=extras
        )

    def close(self):
        del self.ddp, self.optimizer, self.model
        _gc()


def time_logprob_pass(run, tokens, mb: int, reps: int, device) -> dict:
    """The forward-only logprob pass over the step's rows at micro-batches of `mb` (the old-policy and reference
    passes of a GRPO step): median ms of `reps` after one untimed pass."""
    times = []
    with torch.no_grad():
        for i in range(1 + reps):
            _sync(device)
            t0 = time.perf_counter()
            run.logprobs(tokens, mb)
            _sync(device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"logprob_ms": times[len(times) // 2], "logprob_micro_batch": mb}


def offload_round_trip(run, device) -> dict:
    """What `rollout.offload` costs the GRPO step once per step: the release after the sync (gradients freed, the
    optimizer's bytes copied to pinned host memory, the policy's FP8 weight copies dropped), the copy back, and the
    FP8 copies made again by the next forward, each timed to the device's end (in GRPO the copy back overlaps the
    logprob passes), with the GiB freed; best of three."""
    from megatron_jetrl.actor.fp8_layers import fp8_weights
    from megatron_jetrl.actor.offload import TrainStateOffload

    off, times = TrainStateOffload(run.ddp, run.optimizer, run.cfg.rollout.offload), []
    for _ in range(3):
        fp8_weights(run.ddp)  # the sync's stream makes the policy's FP8 copies
        _sync(device)
        t0 = time.perf_counter()
        freed = off.release()
        dropped = off.drop_fp8_copies()
        _sync(device)
        t1 = time.perf_counter()
        off.restore()
        off.wait()
        _sync(device)
        t2 = time.perf_counter()
        fp8_weights(run.ddp)
        _sync(device)
        times.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3))
    release, restore, requantize = min(times)
    return {
        "offload_release_ms": release,
        "offload_restore_ms": restore,
        "offload_requantize_ms": requantize,
        "offload_gib": freed / 2**30,
        "fp8_dropped_gib": dropped / 2**30,
        "offload_gbps": 2 * freed / ((release + restore) / 1e3) / 1e9,
    }


def make_batch(vocab, batch, seq, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    mask = torch.zeros(batch, seq - 1)
    mask[:, seq // 4 :] = 1.0
    adv = torch.randn(batch, generator=g)
    return tokens, mask.to(device), adv.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def probe_layers(a, variants, cfgs, arch, device):
    """Layers that fit the budget for every variant, from the peak memory of a one-micro-batch step at 1 and 2 layers."""
    from megatron_jetrl.actor.logprobs import response_start

    free, total = torch.cuda.mem_get_info()
    budget = free + torch.cuda.memory_allocated()
    budget = (budget if a.mem_gib is None else min(budget, int(a.mem_gib * 2**30))) * 0.9
    tokens, mask, adv = make_batch(arch.vocab_size, a.micro_batch, a.seq, device)
    lp0 = torch.full((a.micro_batch, a.seq - 1), -math.log(arch.vocab_size), device=device)
    extras = {"old": lp0, "adv": adv, "mask": mask, "rollout": lp0, "ref": lp0, "first": response_start(mask)}
    fits = {}
    for label, _, _ in variants:
        peaks = {}
        for n in (1, 2):
            base = torch.cuda.memory_allocated()
            run = StepRun(label, cfgs[label], arch, n, device)
            run.step(tokens, extras, a.micro_batch)
            _sync(device)
            torch.cuda.reset_peak_memory_stats()
            run.step(tokens, extras, a.micro_batch)  # the Adam state exists now
            _sync(device)
            peaks[n] = torch.cuda.max_memory_allocated() - base
            run.close()
        per_layer = peaks[2] - peaks[1]
        fixed = peaks[1] - per_layer
        n_fit = int((budget - fixed) // per_layer) if per_layer > 0 else 1
        fits[label] = dict(
            peak_1_layer_gib=peaks[1] / 2**30,
            peak_2_layers_gib=peaks[2] / 2**30,
            per_layer_gib=per_layer / 2**30,
            fixed_gib=fixed / 2**30,
            fits=n_fit,
        )
        print(
            f"  memory probe {label:28s} fixed {fixed / 2**30:6.1f} GiB + {per_layer / 2**30:5.2f} GiB/layer -> {n_fit} layers "
            f"in {budget / 2**30:.0f} GiB",
            flush=True,
        )
    layers = max(1, min(arch.num_layers, min(f["fits"] for f in fits.values())))
    return layers, {"budget_gib": budget / 2**30, "free_gib": free / 2**30, "total_gib": total / 2**30, "variants": fits}


def run_variants(a, variants, cfgs, arch, layers, device):
    """Every variant at `layers` layers: check against BF16, then time the steps. Returns rows."""
    from megatron_jetrl.actor.logprobs import response_start

    batch = a.micro_batch * a.micro_batches
    tokens, mask, adv = make_batch(arch.vocab_size, batch, a.seq, device)
    rows, state, old = [], None, None
    cuda = device.type == "cuda"
    for label, mode, _ in variants:
        row = {
            "variant": label,
            "mode": mode,
            "layers": layers,
            "tokens_per_step": batch * a.seq,
            "micro_batches": a.micro_batches,
            "micro_batch": a.micro_batch,
            "seq": a.seq,
        }
        run = None
        try:
            run = StepRun(label, cfgs[label], arch, layers, device, state=state)
            row["kv_scales_from_amax"] = run.set_kv_scales(tokens[: a.micro_batch], a.micro_batch)
            row["flow"] = run.flow.to_dict()
            row["core_attention"] = run.core_attention
            try:
                from megatron_jetrl.fp8.gemm import resolve_backend

                row["backend_resolved"] = resolve_backend(run.flow.backend, device) if run.flow.train_fp8 else None
            except Exception as e:  # noqa: BLE001
                row["backend_resolved"] = f"unavailable ({type(e).__name__})"
            if state is None:  # the baseline: its weights and logprobs are every other variant's reference
                state = run.cpu_state()
                with torch.no_grad():
                    old = run.logprobs(tokens, a.micro_batch).float()
                lp = old[: a.micro_batch]
                row["lp_rel_err_vs_bf16"] = 0.0
            else:
                with torch.no_grad():
                    lp = run.logprobs(tokens[: a.micro_batch], a.micro_batch).float()
                ref = old[: a.micro_batch]
                c, cr = lp - lp.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
                err = float((c - cr).norm() / cr.norm().clamp_min(1e-30))
                row["lp_rel_err_vs_bf16"] = err
                if not (math.isfinite(err) and err < 0.5):
                    raise RuntimeError(
                        f"logprobs differ from BF16 on the same weights: centered relative error {err:.3g} (bound 0.5)"
                    )
            if not bool(torch.isfinite(lp).all()):
                raise RuntimeError("non-finite logprobs before training")
            extras = {"old": old, "adv": adv, "mask": mask, "rollout": old, "ref": old, "first": response_start(mask)}
            threads = {"device": (True,), "caller": (False,), "both": (True, False)}[a.backward_thread]
            times, results, retries, caller_times = [], [], 0, []
            for i in range(len(threads) * (a.warmup + a.steps)):
                if i == len(threads) * a.warmup and cuda:
                    torch.cuda.reset_peak_memory_stats()
                    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
                threaded = threads[i % len(threads)]
                _sync(device)
                t0 = time.perf_counter()
                with torch.autograd.set_multithreading_enabled(threaded):
                    out = run.step(tokens, extras, a.micro_batch)
                _sync(device)
                dt = (time.perf_counter() - t0) * 1e3
                results.append(out)
                if i == 0 and not (out.get("ok") and math.isfinite(out.get("loss", float("nan")))):
                    raise RuntimeError(f"first step not taken or not finite: {out}")
                if i >= len(threads) * a.warmup:
                    (times if threaded or len(threads) == 1 else caller_times).append(dt)
            if caller_times:
                row["step_ms_caller_thread"] = sorted(caller_times)[len(caller_times) // 2]
            row.update(time_logprob_pass(run, tokens, a.logprob_micro_batch or a.micro_batch, a.steps, device))
            if run.cfg.rollout.offload != "none":
                row.update(offload_round_trip(run, device))
            if a.step_profile:
                row["profile"] = profile_step(lambda: run.step(tokens, extras, a.micro_batch), [], iters=1)
            if a.host_profile:
                row["host_profile"] = host_profile(lambda: run.step(tokens, extras, a.micro_batch), a.host_profile, label)
            times.sort()
            row.update(
                step_ms=times[len(times) // 2],
                step_ms_all=times,
                tokens_per_s=batch * a.seq / (times[len(times) // 2] / 1e3),
                first_loss=results[0].get("loss"),
                first_grad_norm=results[0].get("grad_norm"),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                # the caching allocator freeing its cache and retrying cudaMalloc (slow) in the timed steps
                alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries if cuda else 0,
            )
        except torch.cuda.OutOfMemoryError:
            if run is not None:
                run.close()
            raise
        except Exception as e:  # noqa: BLE001 - reported in the table; the other variants still run
            import traceback

            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if run is not None:
            run.close()
        rows.append(row)
        base = rows[0].get("step_ms")
        if base and row.get("step_ms"):
            row["speedup_vs_bf16"] = base / row["step_ms"]
            row["logprob_speedup_vs_bf16"] = rows[0]["logprob_ms"] / row["logprob_ms"]
            if rows[0].get("first_grad_norm") and row.get("first_grad_norm"):
                row["grad_norm_rel_diff"] = abs(row["first_grad_norm"] / rows[0]["first_grad_norm"] - 1)
        print(
            f"  {label:28s} layers {layers:2d}  "
            + (
                f"step {row['step_ms']:9.1f} ms  {row['tokens_per_s']:9.0f} tok/s  x{row.get('speedup_vs_bf16', float('nan')):.3f}  "
                f"logprob pass {row['logprob_ms']:8.1f} ms x{row.get('logprob_speedup_vs_bf16', float('nan')):.3f}  "
                f"lp err {row['lp_rel_err_vs_bf16']:.3g}  loss {row['first_loss']:.4g}  grad_norm {row['first_grad_norm']}  "
                f"peak {row['peak_gib']:.1f} GiB  alloc retries {row['alloc_retries']}"
                + (
                    f"  step, backward on the caller's thread {row['step_ms_caller_thread']:.1f} ms"
                    if "step_ms_caller_thread" in row
                    else ""
                )
                if "step_ms" in row
                else f"FAILED: {row.get('error')}"
            )
            + (
                f"  offload {row['offload_gib']:.2f} GiB + FP8 {row['fp8_dropped_gib']:.2f} GiB: release "
                f"{row['offload_release_ms']:.1f} ms, back {row['offload_restore_ms']:.1f} ms, FP8 again "
                f"{row['offload_requantize_ms']:.1f} ms"
                if "offload_gib" in row
                else ""
            ),
            flush=True,
        )
    del state
    _gc()
    return rows


def step_main(a):
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    variants = parse_modes(a.modes)
    from megatron_jetrl.actor.parallel import destroy_parallel
    from megatron_jetrl.models.arch import ModelArch

    tiny = ["precision.exact_logprobs=false"] if a.tiny else []  # the CPU has no FA3
    cfgs = {label: load_preset(mode, a.preset, [*tiny, *ov, *a.override]) for label, mode, ov in variants}
    exact = [label for label in cfgs if cfgs[label].precision.exact_logprobs]
    if exact and importlib.util.find_spec("vllm") is None:
        print(
            f"error: {exact} run with exact logprobs (the vLLM engine's FA3 attention in the actor) and vLLM is not "
            "importable: run under the vLLM kit (shared/kits/README.md) or pass --override precision.exact_logprobs=false",
            file=sys.stderr,
        )
        return 2
    arch = cfgs[variants[0][0]].arch() if not a.tiny else ModelArch.from_hf_config(dict(TINY, num_hidden_layers=2))
    if a.tiny:
        a.seq, a.micro_batch, a.micro_batches, a.steps, a.warmup = min(a.seq, 64), 2, 2, 1, 1
        if a.layers == ["auto"]:
            a.layers = ["2"]
    arch = one_rank(arch, a.seq)
    print(
        f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}; actor step: hidden "
        f"{arch.hidden_size}, ffn {arch.intermediate_size}, heads {arch.num_heads}/{arch.num_kv_heads}x{arch.head_dim}, vocab "
        f"{arch.vocab_size}; {a.micro_batches} micro-batches of {a.micro_batch}x{a.seq} tokens per step",
        flush=True,
    )
    for label, _, _ in variants:
        c = cfgs[label]
        print(f"  {label}: precision {c.precision.to_dict()}  optim {c.optim}", flush=True)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "bench": "step",
        "preset": a.preset,
        "args": {k: v for k, v in vars(a).items()},
        "rows": [],
    }
    counts = []
    for item in a.layers:
        if item == "auto":
            if not cuda:
                counts.append(2)
                continue
            try:
                n, probe = probe_layers(a, variants, cfgs, arch, device)
            except torch.cuda.OutOfMemoryError as e:
                n, probe = 1, {"error": f"out of memory in the probe: {str(e)[:200]}"}
                print(f"  memory probe ran out of memory: 1 layer ({str(e)[:120]})", flush=True)
            _gc()
            out["memory_probe"] = probe
            counts.append(n)
        else:
            counts.append(int(item))
    for layers in sorted(set(counts)):
        while True:
            try:
                out["rows"] += run_variants(a, variants, cfgs, arch, layers, device)
                break
            except torch.cuda.OutOfMemoryError as e:
                oom = str(e)[:200]
            # freed only here, after the except block: its traceback holds the failed step's frames and tensors
            _gc()
            if layers <= 1:
                out.setdefault("errors", []).append(f"out of memory at 1 layer: {oom}")
                break
            smaller = max(1, int(layers * 0.8))
            print(f"  out of memory at {layers} layers: retrying with {smaller}", flush=True)
            out["rows"] = [r for r in out["rows"] if r["layers"] != layers]
            layers = smaller
        if a.json:
            _write_json(a.json, out)
    destroy_parallel()
    report_steps(out, arch)
    if a.json:
        _write_json(a.json, out)
    return 1 if out.get("errors") or any("error" in r for r in out["rows"]) else 0


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def report_steps(out, arch):
    rows = out["rows"]
    print(
        "\n| layers | variant | backend | core attention | step ms (median) | tokens/s | vs BF16 | logprob pass ms | vs BF16 | "
        "logprob rel. err vs BF16 | first loss | grad norm | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            print(
                f"| {r['layers']} | {r['variant']} | - | {r.get('core_attention', '-')} | n/a: {r.get('error', '')[:80]} | | | | | | | | |"
            )
            continue
        print(
            f"| {r['layers']} | {r['variant']} | {r.get('backend_resolved') or '-'} | {r.get('core_attention', '-')} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r.get('speedup_vs_bf16', float('nan')):.2f}x | {r['logprob_ms']:.1f} | {r.get('logprob_speedup_vs_bf16', float('nan')):.2f}x | "
            f"{r['lp_rel_err_vs_bf16']:.3g} | {r['first_loss']:.4g} | "
            f"{r['first_grad_norm'] if r['first_grad_norm'] is None else round(r['first_grad_norm'], 4)} | {r['peak_gib']:.1f} |"
        )
    by_variant: dict[str, dict[int, float]] = {}
    for r in rows:
        if "step_ms" in r:
            by_variant.setdefault(r["variant"], {})[r["layers"]] = r["step_ms"]
    full = arch.num_layers
    if len(by_variant.get("bf16", {})) >= 2:
        print(f"\nextrapolated to {full} layers (linear fit of step ms over the layer counts):")
        out["extrapolated"] = {}
        fit = {}
        for v, pts in by_variant.items():
            if len(pts) < 2:
                continue
            xs, ys = list(pts), [pts[x] for x in pts]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            fit[v] = my + slope * (full - mx)
            out["extrapolated"][v] = {"per_layer_ms": slope, "fixed_ms": my - slope * mx, f"step_ms_{full}_layers": fit[v]}
        for v, t in fit.items():
            print(f"  {v:28s} {t:9.1f} ms  x{fit['bf16'] / t:.3f}  (per layer {out['extrapolated'][v]['per_layer_ms']:.1f} ms)")
    offloaded = [r for r in rows if "offload_gib" in r]
    if offloaded:
        print(
            "\n| layers | variant | offloaded GiB | FP8 dropped GiB | release ms | copy back ms | FP8 again ms | "
            "GB/s both ways | vs step ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in offloaded:
            cost = r["offload_release_ms"] + r["offload_restore_ms"] + r["offload_requantize_ms"]
            print(
                f"| {r['layers']} | {r['variant']} | {r['offload_gib']:.2f} | {r['fp8_dropped_gib']:.2f} | "
                f"{r['offload_release_ms']:.1f} | {r['offload_restore_ms']:.1f} | {r['offload_requantize_ms']:.1f} | "
                f"{r['offload_gbps']:.1f} | {cost / r['step_ms']:.1%} |"
            )
    print_profiles(rows, "GPU kernel time of one step (torch.profiler, ms; GEMM includes the BF16 lm_head):")
    for r in rows:
        if r["mode"] == "jetrl" and r["variant"] == "jetrl" and "speedup_vs_bf16" in r:
            ok = r["speedup_vs_bf16"] >= STEP_TARGET
            print(
                f"target: whole actor step jetrl (shipped preset) >= {STEP_TARGET}x BF16 at {r['layers']} layers: "
                f"{r['speedup_vs_bf16']:.2f}x -> {'MET' if ok else 'NOT MET'}"
            )


def profile_variants(profile, variants) -> list[str]:
    """The layer variants `--profile` asks for: as given; a bare `--profile` ([]), every variant; absent (None), bf16
    and jetrl where `variants` has them."""
    if profile is None:
        return [v for v in ("bf16", "jetrl") if v in variants]
    return list(variants) if not profile else list(profile)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", action="store_true", help="benchmark one decoder layer instead of the whole step")
    p.add_argument("--tiny", action="store_true", help="smoke run: hidden 256, a few tokens (CPU: emulated FP8)")
    p.add_argument("--json", default=None)
    g = p.add_argument_group("whole step")
    g.add_argument(
        "--modes",
        nargs="+",
        default=["bf16", "jetrl"],
        help="MODE[+section.key=value...]: a configs/modes preset plus overrides; bf16 is the baseline",
    )
    g.add_argument("--preset", default=DEFAULT_PRESET, help="model preset the modes compose onto (default Qwen3-8B-Base)")
    g.add_argument("--override", nargs="*", default=[], help="section.key=value overrides for every variant")
    g.add_argument("--layers", nargs="+", default=["auto"], help="layer counts, or auto (fit --mem-gib)")
    g.add_argument(
        "--mem-gib",
        type=float,
        default=None,
        help="memory budget of --layers auto (default: all free memory; a smaller one compares H100 and H200)",
    )
    g.add_argument("--seq", type=int, default=4096)
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (M = micro-batch x seq tokens per GEMM)")
    g.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step")
    g.add_argument(
        "--logprob-micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch of the timed logprob pass (grpo.logprob_micro_batch_size; default --micro-batch)",
    )
    g.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    g.add_argument(
        "--step-profile",
        action="store_true",
        help="after timing, profile one more step of every variant: GPU kernel time by category",
    )
    g.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, one more step of every variant under cProfile: its N costliest functions by self time "
        "(the host's own work; waits on the GPU show as the sync calls)",
    )
    p.add_argument(
        "--backward-thread",
        choices=("device", "caller", "both"),
        default="device",
        help="where a step's backward runs: autograd's device thread (torch's default), the calling thread "
        "(torch.autograd.set_multithreading_enabled(False)), or both, alternating step by step in one process "
        "(step_ms: device; step_ms_caller_thread: caller)",
    )
    g = p.add_argument_group("one layer (--layer)")
    g.add_argument("--shapes", nargs="*", default=["4096x2", "8192x1"], help="SEQxMICRO_BATCH")
    g.add_argument("--variants", nargs="*", default=["bf16", "jetrl", "jetrl/cublaslt", "jetrl/cublaslt+requant"])
    g.add_argument("--rep-ms", type=int, default=200)
    g.add_argument(
        "--profile",
        nargs="*",
        default=None,
        help="variants to profile (kernel time by category) on the last shape; a bare --profile: every "
        "variant (default: bf16 and jetrl, where --variants runs them)",
    )
    a = p.parse_args(argv)
    a.profile = profile_variants(a.profile, a.variants)
    if a.layer and (unknown := [v for v in a.profile if v not in a.variants]):
        p.error(f"--profile names variants that --variants does not run: {unknown} (running: {a.variants})")
    bad = [x for x in a.layers if x != "auto" and not (x.isdigit() and int(x) >= 1)]
    if bad:
        p.error(f"--layers takes positive integers or auto, got {bad}")
    for name in ("seq", "micro_batch", "micro_batches", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles kernels and allocates the optimizer state)")
    if not a.layer:
        parse_modes(a.modes)  # unknown modes and malformed overrides: exit 2 before anything is built
    if not torch.cuda.is_available() and not a.tiny:
        print(
            "error: tools/bench/bench_actor.py needs a CUDA GPU and none is visible here; run it on the GPU machine "
            "(bash tools/gpu/gpu_fp8.sh bench), or --tiny for a CPU smoke run",
            file=sys.stderr,
        )
        return 2
    if a.layer:
        layer_main(a)
        return 0
    return step_main(a)


if __name__ == "__main__":
    sys.exit(main())
