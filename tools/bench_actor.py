#!/usr/bin/env python3
"""Step time of one megatron-core actor layer (the native Jet-RL spec): FP8 (`jetrl`) against BF16.

    PYTHONPATH=. python3 tools/bench_actor.py [--shapes 4096x2 8192x1] [--json PATH]   # one GPU
    PYTHONPATH=. python3 tools/bench_actor.py --tiny                                  # CPU smoke run

The layer is what `actor.provider.build_model` puts in the decoder: megatron's `TransformerLayer` built
from the native spec (`actor.provider.layer_spec(arch, flow, "native", 1)`) with `actor.provider.transformer_config`
(Qwen3-8B shapes: hidden 4096, intermediate 12288, 32 heads, 8 KV heads, head_dim 128, QK-norm; BF16
params), megatron RoPE, input `[seq, micro_batch, hidden]` BF16. Each variant gets the same weights.

Variants (FP8 ones with `check_finite=False` unless named):
  bf16                    megatron's plain ColumnParallel/RowParallel linears
  jetrl/cublaslt          FP8 linears on cuBLASLt; weight FP8 bytes cached (later micro-batches of a step)
  jetrl/cublaslt+requant  the same, re-quantizing all four weights every iteration (one micro-batch per step)
  jetrl/cublaslt+finite   check_finite=True (one host sync per quantization)
  jetrl/triton            FP8 linears on the Triton GEMM
Core attention: `local` = megatron's DotProductAttention (what the native spec uses: unfused baddbmm +
FP32 softmax + bmm over [b*heads, s, s]) and `sdpa` = this tool's drop-in that calls
`F.scaled_dot_product_attention(is_causal=True)` (flash), to show the layer with a fused attention core.

Times: `triton.testing.do_bench` medians (ms) of the forward with autograd recording (what training
runs) and of forward+backward; backward = the difference. Also reported: ||y - y_bf16|| / ||y_bf16|| of
the layer output (sanity: FP8 noise, not garbage) and the peak memory of the fwd+bwd. `--profile` variants
(default bf16 and jetrl/cublaslt) on the last shape also get their GPU kernel time per fwd+bwd from
`torch.profiler`, summed by category (GEMM, Triton quantizers, attention core, copies, the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, num_hidden_layers=1, max_position_embeddings=40960, rope_theta=1_000_000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(QWEN3_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
VARIANTS = {
    "bf16": dict(mode="bf16"),
    "jetrl/cublaslt": dict(mode="jetrl", backend="cublaslt", check_finite=False),
    "jetrl/cublaslt+requant": dict(mode="jetrl", backend="cublaslt", check_finite=False),
    "jetrl/cublaslt+finite": dict(mode="jetrl", backend="cublaslt", check_finite=True),
    "jetrl/triton": dict(mode="jetrl", backend="triton", check_finite=False),
    "jetrl/emulated": dict(mode="jetrl", backend="emulated", check_finite=False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sdpa_core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPACoreAttention(DotProductAttention):
        """megatron's DotProductAttention interface, computed by torch SDPA (causal, flash on GPU)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            s, b = query.shape[0], query.shape[1]
            rep = query.shape[2] // key.shape[2]
            q = query.permute(1, 2, 0, 3)
            k = key.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
            v = value.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


def build_layer(arch, flow, attn: str, dtype):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_jetrl.actor.provider import ActorOptions, layer_spec, transformer_config

    config = transformer_config(arch, flow, tp=1, pp=1, options=ActorOptions(params_dtype=dtype))
    spec = layer_spec(arch, flow, "native", 1).layer_specs[0]  # the decoder's layer, as build_model makes it
    if attn == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention_class()
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
    ("quantize (Triton)", ("_quant",)),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "_gemm_tma", "_gemm_ptr")),
    ("attention core", ("flash", "fmha", "attention", "softmax")),
    ("copy/transpose/cat", ("copy", "transpose", "cat", "memcpy", "memset")),
)


def profile_step(fn, params, iters: int = 3) -> dict:
    """GPU kernel time of one `fn()` (mean of `iters`), by category and the top kernels (torch.profiler)."""
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
    for ev in prof.key_averages():
        if cuda:  # kernels (CUPTI events)
            us = ev.device_time_total if str(ev.device_type).endswith("CUDA") else 0.0
        else:  # CPU dry run: aten ops' own time
            us = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0.0
        if us:
            kernels[ev.key] = kernels.get(ev.key, 0.0) + us / 1e3 / iters
    cats: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "elementwise/norm/other")
        cats[cat] = cats.get(cat, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"total_ms": sum(kernels.values()), "categories": cats, "top": top}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=["4096x2", "8192x1"], help="SEQxMICRO_BATCH")
    p.add_argument("--variants", nargs="*", default=["bf16", "jetrl/cublaslt", "jetrl/cublaslt+requant", "jetrl/cublaslt+finite", "jetrl/triton"])
    p.add_argument("--attn", nargs="*", default=["local", "sdpa"])
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--profile", nargs="*", default=["bf16", "jetrl/cublaslt"],
                   help="variants to profile (kernel time by category) on the last shape, every core attention")
    p.add_argument("--tiny", action="store_true", help="smoke run: hidden 256, 64x2 tokens (CPU: emulated FP8)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
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

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    init_parallel(tp=1, pp=1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArch.from_hf_config(cfg)
    print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}; layer hidden {arch.hidden_size}, "
          f"ffn {arch.intermediate_size}, heads {arch.num_heads}/{arch.num_kv_heads}x{arch.head_dim}", flush=True)
    rope = RotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0, rotary_base=arch.rope_theta,
                           use_cpu_initialization=not cuda)
    torch.manual_seed(0)
    ref_state = build_layer(arch, PrecisionFlow("bf16"), "local", dtype).state_dict()
    ref_state = {k: v.detach().clone() for k, v in ref_state.items() if v is not None and isinstance(v, torch.Tensor)}
    rows = []
    for shape in a.shapes:
        seq, mb = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(1)
        x0 = torch.randn(seq, mb, arch.hidden_size, generator=g, device=device, dtype=dtype)
        dy = torch.randn(seq, mb, arch.hidden_size, generator=g, device=device, dtype=dtype) * 1e-2
        emb = rope(seq)
        for attn in a.attn:
            y_ref = None
            base = {}
            for name in a.variants:
                flow = PrecisionFlow(**VARIANTS[name])
                layer = build_layer(arch, flow, attn, dtype)
                missing, unexpected = layer.load_state_dict(ref_state, strict=False)
                if [m for m in missing if not m.endswith("_extra_state")] or unexpected:
                    raise RuntimeError(f"{name}: state mismatch {missing} {unexpected}")
                x = x0.clone().requires_grad_(True)
                mods = fp8_modules(layer)
                requant = name.endswith("+requant")

                def fwd():
                    if requant:
                        for m in mods:
                            m._fp8_cache = None
                    return layer(x, attention_mask=None, rotary_pos_emb=emb)[0]

                def fwd_bwd():
                    fwd().backward(dy)

                params = [x] + list(layer.parameters())
                with torch.no_grad():
                    y = layer(x, attention_mask=None, rotary_pos_emb=emb)[0].float()
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
                row = dict(shape=shape, tokens=seq * mb, attn=attn, variant=name, fwd_ms=t_fwd, fwd_bwd_ms=t_all,
                           bwd_ms=t_all - t_fwd, rel_err_vs_bf16=err, finite=finite, peak_gib=peak, fp8_linears=len(mods))
                if name == "bf16":
                    base = row
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
                print(f"{shape:8s} {attn:5s} {name:24s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms  bwd {t_all - t_fwd:8.3f} ms  "
                      f"x{row['speedup_fwd_bwd']:.3f}  err {err:.3g}  finite {finite}  peak {peak:.1f} GiB", flush=True)
                del layer, x, mods, params
                if cuda:
                    torch.cuda.empty_cache()
    destroy_parallel()
    print("\n| tokens (seq x mb) | core attention | variant | fwd ms | bwd ms | fwd+bwd ms | vs BF16 fwd / bwd / fwd+bwd | rel. err vs BF16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} ({r['shape']}) | {r['attn']} | {r['variant']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
              f"{r['speedup_fwd']:.2f}x / {r['speedup_bwd']:.2f}x / {r['speedup_fwd_bwd']:.2f}x | {r['rel_err_vs_bf16']:.3g} |")
    prof = [r for r in rows if r.get("profile")]
    if prof:
        cats = sorted({c for r in prof for c in r["profile"]["categories"]})
        print(f"\nGPU kernel time per fwd+bwd (torch.profiler, ms), {a.shapes[-1]}:")
        print("| core attention | variant | " + " | ".join(cats) + " | sum of kernels |")
        print("|---|---|" + "---|" * (len(cats) + 1))
        for r in prof:
            c = r["profile"]["categories"]
            print(f"| {r['attn']} | {r['variant']} | " + " | ".join(f"{c.get(k, 0.0):.2f}" for k in cats) + f" | {r['profile']['total_ms']:.2f} |")
        for r in prof:
            print(f"top kernels {r['attn']} {r['variant']}: " + "; ".join(f"{n[:60]} {ms:.2f}" for n, ms in r["profile"]["top"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(device) if cuda else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
