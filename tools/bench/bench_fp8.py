#!/usr/bin/env python3
"""FP8 benchmarks on one CUDA GPU, in one go: ceilings, quantizers, GEMMs, FP8 linear, one decoder layer, profile.

    PYTHONPATH=. python3 tools/bench/bench_fp8.py [--json bench_fp8.json] [--sweep] [--sections linear layer profile ...]

Sections (each runs on its own; default: ceilings quant gemm linear layer):
  ceilings  device copy GB/s (read + write) and BF16 GEMM TFLOP/s
  quant     the quantization kernels (GB/s = bytes read + written, and % of copy)
  gemm      blockwise GEMMs for the linear shapes of Qwen3-8B, Qwen2.5-7B and Qwen2.5-32B at M = 4096, 8192,
            16384 (TFLOP/s and ratio to BF16 torch.mm on the same shape)
  linear    Qwen3-8B's four linears (qkv, o, gate_up, down) at M = 8192, forward+backward ms and ratio to BF16
            torch.nn.Linear (plain autograd): our FP8Linear with the shipped defaults (`PrecisionFlow(mode="jetrl")`,
            weight.main_grad attached as megatron DDP does), the same with backend="cublaslt", TE te.Linear under
            Float8BlockScaling (when transformer_engine imports) and the DeepGEMM GEMMs alone on pre-quantized
            operands (the ceiling); rows per linear and the sum; targets: sum >= 1.5x, no linear < 1.3x; with the
            ceilings section, the floor: those GEMMs plus the recipe's quantization bytes at the copy rate
  layer     one Qwen3-8B decoder layer (attention BF16, linears FP8, shipped defaults) fwd+bwd; target >= 1.35x
  profile   torch.profiler over fwd+bwd passes of the four FP8 linears (shipped defaults): GPU time per kernel
            and category, where the gap from the DeepGEMM ceiling goes, the GPU's idle time read off the kernel
            timeline (passes issued behind a first one) and the host time to issue one pass
Every variant is checked against an FP32 (or emulated) reference with a bound before it is timed; a variant
that fails is reported as n/a with its error, the others still run. Times are medians of
triton.testing.do_bench (CUDA events, L2 flushed between calls); inputs are random (never zeros) and rotated
among enough sets to exceed 3x the L2 when one set is smaller. `--sweep` also times Triton tile configs (each
checked against the emulated reference first) and prints the best. Without a CUDA GPU: exit 2, one line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, blockwise_gemm, quantize_blockwise  # noqa: E402
from megatron_jetrl.fp8 import kernels as K  # noqa: E402
from megatron_jetrl.fp8.gemm import available_backends, gemm_emulated, resolve_backend  # noqa: E402

DEV = "cuda"
MODELS = {  # hidden, intermediate, q heads, kv heads, head dim
    "Qwen3-8B": (4096, 12288, 32, 8, 128),
    "Qwen2.5-7B": (3584, 18944, 28, 4, 128),
    "Qwen2.5-32B": (5120, 27648, 40, 8, 128),
}
MS = (4096, 8192, 16384)


def linear_shapes(model):
    h, inter, qh, kvh, d = MODELS[model]
    return {"qkv": ((qh + 2 * kvh) * d, h), "o": (h, qh * d), "gate_up": (2 * inter, h), "down": (h, inter)}


def bench(fn, warmup=25, rep=100, grad_to_none=None):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")  # ms


def l2_bytes():
    try:
        return torch.cuda.get_device_properties(0).L2_cache_size
    except Exception:  # noqa: BLE001 - no device or no such property: H100's size
        return 60 << 20


def n_sets(bytes_per_set):
    return max(1, min(8, math.ceil(3 * l2_bytes() / max(bytes_per_set, 1))))


def rotating(fn, sets):
    """fn(*set) over the sets in turn: each call reads a different set of inputs."""
    it = [0]

    def call():
        s = sets[it[0] % len(sets)]
        it[0] += 1
        return fn(*s)

    return call


# ----------------------------------------------------------------------------------------------------


def ceilings(res):
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 2 / t / 1e6
    del src, dst
    m = n_ = k = 8192
    sets = [
        (torch.randn(m, k, device=DEV, dtype=torch.bfloat16), torch.randn(n_, k, device=DEV, dtype=torch.bfloat16))
        for _ in range(2)
    ]
    t = bench(rotating(lambda a, b: torch.mm(a, b.t()), sets))
    bf16 = 2 * m * n_ * k / t / 1e9
    res["ceilings"] = {"copy_GBps": copy_gbs, "bf16_gemm_8192_TFLOPs": bf16}
    print(f"ceilings: device copy {copy_gbs:.0f} GB/s (read+write), BF16 GEMM 8192^3 {bf16:.0f} TFLOP/s", flush=True)
    return copy_gbs


def quant_section(res, copy_gbs, sweep):
    rows = []
    t_, n_ = 16384, 8192
    x = torch.randn(t_, n_, device=DEV, dtype=torch.bfloat16)
    nb = n_ // 128
    tb = t_ // 128
    elems = t_ * n_
    xq, xs = K.quantize_1x128(x, check_finite=False)
    gu = torch.randn(t_, 2 * n_, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(t_, n_, device=DEV, dtype=torch.bfloat16)

    def add(name, fn, nbytes, extra=""):
        try:
            ms = bench(fn)
        except Exception as e:  # noqa: BLE001 - a kernel whose signature changed must not stop the others
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"  {name:44s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "note": extra})
        print(f"  {name:44s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy {extra}", flush=True)

    print(f"quantization kernels on [{t_}, {n_}] (bytes = read + written):", flush=True)
    add("1x128 (bf16 in)", lambda: K.quantize_1x128(x, check_finite=False), elems * 3 + t_ * nb * 4)
    add("1x128 fused SwiGLU ([T, 2I] bf16 in)", lambda: K.swiglu_quantize_1x128(gu, check_finite=False), elems * 5 + t_ * nb * 4)
    add("dual 1x128 + 128x1^T (bf16 in)", lambda: K.quantize_dual(x, check_finite=False), elems * 4 + (t_ * nb + n_ * tb) * 4)
    add("128x1^T only (bf16 in)", lambda: K.quantize_dual(x, check_finite=False, rows=False), elems * 3 + n_ * tb * 4)
    add(
        "128x1^T from E4M3 + 1x128 scales",
        lambda: K.quantize_dual(xq, check_finite=False, rows=False, x_scale=xs),
        elems * 2 + (t_ * nb + n_ * tb) * 4,
    )
    # the shipped dual mode ("cuda": fp8/cuda_tiles.py) against the Triton kernels it replaced
    add(
        "  dual as Triton 1x128 + CUDA 128x1^T",
        lambda: K.quantize_dual(x, check_finite=False, mode="cuda-split"),
        elems * 4 + (t_ * nb + n_ * tb) * 4,
    )
    add(
        "  dual as one CUDA kernel",
        lambda: K.quantize_dual(x, check_finite=False, mode="cuda"),
        elems * 4 + (t_ * nb + n_ * tb) * 4,
    )
    add(
        "  Triton: dual as 1x128 + 128x1^T kernels",
        lambda: K.quantize_dual(x, check_finite=False, mode="split"),
        elems * 4 + (t_ * nb + n_ * tb) * 4,
    )
    add(
        "  Triton: 128x1^T only (bf16 in)",
        lambda: K.quantize_dual(x, check_finite=False, rows=False, mode="split"),
        elems * 3 + n_ * tb * 4,
    )
    add(
        "  Triton: 128x1^T from E4M3 + 1x128 scales",
        lambda: K.quantize_dual(xq, check_finite=False, rows=False, x_scale=xs, mode="split"),
        elems * 2 + (t_ * nb + n_ * tb) * 4,
    )
    # the MLP backward's d[gate | up] (gate_up = gu, d_out = x, I = n_): fused (never stored) against the two kernels;
    # bytes = the fused kernel's (read gate_up and d_out, write rows and columns of [T, 2I])
    sw_bytes = elems * 10 + (t_ * 2 * nb + 2 * n_ * tb) * 4
    add("SwiGLU bwd + dual, one CUDA kernel", lambda: K.swiglu_backward_dual(gu, x, mode="cuda"), sw_bytes)
    add("  SwiGLU bwd + dual as two kernels", lambda: K.swiglu_backward_dual(gu, x, mode="split"), sw_bytes)
    add("  SwiGLU bwd alone (bf16 out)", lambda: K.swiglu_backward(gu, x), elems * 10)
    add("128x128 (bf16 in)", lambda: K.quantize_128x128(w, check_finite=False), elems * 3)
    add("128x128 + transposed copy", lambda: K.quantize_128x128(w, check_finite=False, transposed=True), elems * 4)
    # the shipped 1x128 / 128x128 mode ("cuda": fp8/cuda_tiles.py) against the Triton kernels
    add("  Triton: 1x128 (bf16 in)", lambda: K.quantize_1x128(x, check_finite=False, mode="triton"), elems * 3 + t_ * nb * 4)
    add("  Triton: 128x128 (bf16 in)", lambda: K.quantize_128x128(w, check_finite=False, mode="triton"), elems * 3)
    add(
        "  Triton: 128x128 + transposed copy",
        lambda: K.quantize_128x128(w, check_finite=False, transposed=True, mode="triton"),
        elems * 4,
    )
    add(
        "reference torch quantizer 1x128 (eager)",
        lambda: quantize_blockwise(x, (1, 128), check_finite=False),
        elems * 3 + t_ * nb * 4,
    )
    add("check_finite=True 1x128 (one host sync)", lambda: K.quantize_1x128(x, check_finite=True), elems * 3 + t_ * nb * 4)
    if sweep:
        print("  sweep 1x128 (BLOCK_M, groups/program, warps):", flush=True)
        for bm in (4, 8, 16, 32):
            for gr in (1, 2, 4):
                for wp in (2, 4, 8):
                    if bm * gr * 128 > 16384 or bm * gr * 128 < 64 * wp:
                        continue
                    q, s = K.quantize_1x128(x, check_finite=False, block_m=bm, num_warps=wp, groups=gr)
                    ok = torch.equal(q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(s, xs)
                    ms = bench(lambda: K.quantize_1x128(x, check_finite=False, block_m=bm, num_warps=wp, groups=gr))
                    gbs = (elems * 3 + t_ * nb * 4) / ms / 1e6
                    print(f"    1x128 bm={bm:3d} g={gr} warps={wp} {gbs:6.0f} GB/s ok={ok}", flush=True)
                    rows.append(
                        {
                            "kernel": f"sweep 1x128 bm={bm} g={gr} w={wp}",
                            "ms": ms,
                            "GBps": gbs,
                            "pct_copy": 100 * gbs / copy_gbs,
                            "ok": ok,
                        }
                    )
        _, _, qt0, st0 = K.quantize_dual(x, check_finite=False, rows=False, cols_cfg=dict(block_n=128, trans=True))
        for bn in (16, 32, 64, 128):
            for wp in (2, 4, 8):
                for tr in (True, False):
                    cfg = dict(block_n=bn, num_warps=wp, trans=tr)
                    _, _, qt, st = K.quantize_dual(x, check_finite=False, rows=False, cols_cfg=cfg)
                    ok = torch.equal(qt.view(torch.uint8), qt0.view(torch.uint8)) and torch.equal(st, st0)
                    ms = bench(lambda: K.quantize_dual(x, check_finite=False, rows=False, cols_cfg=cfg))
                    gbs = (elems * 3 + n_ * tb * 4) / ms / 1e6
                    print(f"    cols bn={bn:3d} warps={wp} trans={tr} {gbs:6.0f} GB/s ok={ok}", flush=True)
                    rows.append(
                        {
                            "kernel": f"sweep cols bn={bn} w={wp} trans={tr}",
                            "ms": ms,
                            "GBps": gbs,
                            "pct_copy": 100 * gbs / copy_gbs,
                            "ok": ok,
                        }
                    )
        for wp in (4, 8):
            ms = bench(lambda: K.quantize_dual(x, check_finite=False, num_warps=wp, mode="fused"))
            gbs = (elems * 4 + (t_ * nb + n_ * tb) * 4) / ms / 1e6
            print(f"    dual fused warps={wp} {gbs:6.0f} GB/s", flush=True)
            rows.append({"kernel": f"sweep dual fused w={wp}", "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs})
    res["quant"] = rows


def make_gemm_operands(m, n, k, b_block, count):
    sets = []
    for _ in range(count):
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        a_q, a_s = K.quantize_1x128(a, check_finite=False)
        if b_block == (128, 128):
            b_q, b_s = K.quantize_128x128(b, check_finite=False)
        else:
            b_q, b_s = K.quantize_1x128(b, check_finite=False)
        sets.append((a, b, a_q, a_s, b_q, b_s))
    return sets


def check_rows(out, a_q, a_s, b_q, b_s, b_block, rows=256):
    want = gemm_emulated(a_q[:rows], a_s[:rows], b_q, b_s, b_block, torch.float64)
    got = out[:rows].double()
    return ((got - want).norm() / want.norm()).item()


SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, GROUP_M, warps, stages, tma[, lookahead[, warp_specialize]])
    (128, 128, 8, 8, 3, True),
    (128, 128, 8, 8, 4, True),
    (128, 64, 8, 4, 5, True),
    (128, 64, 8, 4, 4, True),
    (128, 64, 8, 4, 6, True),
    (128, 64, 16, 4, 5, True),
    (64, 128, 8, 4, 5, True),
    (64, 64, 8, 4, 6, True),
    (256, 64, 8, 8, 4, True),
    (128, 64, 8, 4, 5, False),
    (128, 128, 8, 8, 4, False),
    (128, 64, 8, 4, 4, True, True),
    (128, 128, 8, 8, 3, True, True),
    (256, 64, 8, 8, 3, True, True),
    (128, 64, 8, 4, 4, True, False, True),
    (128, 128, 8, 8, 3, True, False, True),
]


def gemm_sweep(res):
    print("triton GEMM tile sweep (BLOCK_M, BLOCK_N, GROUP_M, warps, stages, tma):", flush=True)
    out = []
    for m, n, k, b_block, label in [
        (8192, 24576, 4096, (128, 128), "8B gate_up M=8192"),
        (8192, 4096, 4096, (128, 128), "8B o M=8192"),
        (4096, 4096, 8192, (1, 128), "8B wgrad o (N=4096,K=4096,T=8192)"),
        (12288, 4096, 8192, (1, 128), "8B wgrad down (12288x4096, T=8192)"),
    ]:
        sets = make_gemm_operands(m, n, k, b_block, 1)
        _, _, a_q, a_s, b_q, b_s = sets[0]
        for cfg in SWEEP_CONFIGS:
            c = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
            try:
                K.gemm(a_q, a_s, b_q, b_s, b_block, torch.bfloat16, config=cfg, out=c)
                torch.cuda.synchronize()
                err = check_rows(c, a_q, a_s, b_q, b_s, b_block)
                ok = bool(torch.isfinite(c).all()) and err < 4e-3
                ms = bench(lambda: K.gemm(a_q, a_s, b_q, b_s, b_block, torch.bfloat16, config=cfg, out=c))
                tf = 2 * m * n * k / ms / 1e9
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                ok, err, tf = False, float("nan"), 0.0
                print(f"    {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            print(f"  {label:36s} {str(cfg):32s} {tf:7.0f} TFLOP/s err {err:.1e} ok={ok}", flush=True)
            out.append({"shape": label, "config": cfg, "TFLOPs": tf, "err": err, "ok": ok})
        del sets, c
        torch.cuda.empty_cache()
    res["gemm_sweep"] = out


def gemm_section(res, backends, models=tuple(MODELS), ms_list=MS):
    rows = []
    print("blockwise FP8 GEMM (A 1x128, W 128x128), bf16 out; TFLOP/s and ratio to BF16 torch.mm:", flush=True)
    for model in models:
        for name, (n, k) in linear_shapes(model).items():
            for m in ms_list:
                set_bytes = (m * k + n * k) * 3 + m * n * 2
                cnt = n_sets(set_bytes)
                sets = make_gemm_operands(m, n, k, (128, 128), cnt)
                flops = 2 * m * n * k
                t_bf = bench(rotating(lambda a, b, *_: torch.mm(a, b.t()), sets))
                row = {"model": model, "linear": name, "M": m, "N": n, "K": k, "bf16_TFLOPs": flops / t_bf / 1e9}
                for be in backends:
                    fn = rotating(lambda a, b, a_q, a_s, b_q, b_s: blockwise_gemm(a_q, a_s, b_q, b_s, backend=be), sets)
                    t = bench(fn)
                    row[f"{be}_TFLOPs"] = flops / t / 1e9
                    row[f"{be}_ratio"] = t_bf / t
                rows.append(row)
                print(
                    f"  {model:12s} {name:8s} M={m:5d} N={n:5d} K={k:5d}  bf16 {row['bf16_TFLOPs']:5.0f}  "
                    + "  ".join(f"{be} {row[be + '_TFLOPs']:5.0f} ({row[be + '_ratio']:.2f}x)" for be in backends),
                    flush=True,
                )
                del sets
            torch.cuda.empty_cache()
    # the two backward GEMM shapes of the 8B linears at M = 8192
    print("backward GEMMs, Qwen3-8B, T = 8192 (DGrad: dY . W, W^T K-major; WGrad: 1x128 . 1x128 over tokens):", flush=True)
    for name, (n, k) in linear_shapes("Qwen3-8B").items():
        for kind, (gm, gn, gk, bb) in {"dgrad": (8192, k, n, (128, 128)), "wgrad": (n, k, 8192, (1, 128))}.items():
            cnt = n_sets((gm * gk + gn * gk) * 3 + gm * gn * 2)
            sets = make_gemm_operands(gm, gn, gk, bb, cnt)
            flops = 2 * gm * gn * gk
            t_bf = bench(rotating(lambda a, b, *_: torch.mm(a, b.t()), sets))
            row = {"model": "Qwen3-8B", "linear": f"{name} {kind}", "M": gm, "N": gn, "K": gk, "bf16_TFLOPs": flops / t_bf / 1e9}
            for be in backends:
                t = bench(
                    rotating(lambda a, b, a_q, a_s, b_q, b_s: blockwise_gemm(a_q, a_s, b_q, b_s, b_block=bb, backend=be), sets)
                )
                row[f"{be}_TFLOPs"] = flops / t / 1e9
                row[f"{be}_ratio"] = t_bf / t
            rows.append(row)
            print(
                f"  {name:8s} {kind}  M={gm:5d} N={gn:5d} K={gk:5d}  bf16 {row['bf16_TFLOPs']:5.0f}  "
                + "  ".join(f"{be} {row[be + '_TFLOPs']:5.0f} ({row[be + '_ratio']:.2f}x)" for be in backends),
                flush=True,
            )
            del sets
        torch.cuda.empty_cache()
    res["gemm"] = rows


# ---- the FP8 linear against BF16, TE and the DeepGEMM GEMM ceiling -----------------------------------

LINEAR_TARGETS = {"sum": 1.5, "each": 1.3, "layer": 1.35}


def shipped_flow() -> PrecisionFlow:
    """What users run: `PrecisionFlow(mode="jetrl")` with every other field at its default."""
    return PrecisionFlow(mode="jetrl")


def describe_flow(flow: PrecisionFlow) -> str:
    try:
        resolved = resolve_backend(flow.backend, torch.device(DEV))
    except Exception as e:  # noqa: BLE001 - reported, the timing will fail with the real error
        resolved = f"unavailable ({type(e).__name__})"
    return f"backend={flow.backend}->{resolved}, check_finite={flow.check_finite!r}, scale_mode={flow.scale_mode}"


def import_deep_gemm():
    """DeepGEMM as the library finds it (`deep_gemm`, else vLLM's bundle), or None."""
    try:
        from megatron_jetrl.fp8.backends import deep_gemm_module

        return deep_gemm_module()
    except ImportError:  # a library without that helper: look for it here
        pass
    try:
        import deep_gemm

        return deep_gemm
    except Exception:  # noqa: BLE001 - ImportError, or a bundle that fails to initialize
        pass
    try:
        from vllm.third_party import deep_gemm

        return deep_gemm
    except Exception:  # noqa: BLE001
        return None


def import_te():
    """(transformer_engine.pytorch, Float8BlockScaling) or (None, reason)."""
    os.environ.update({k: v for k, v in shipped_flow().te_env().items() if k not in os.environ})  # read once at import
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8BlockScaling

        return te, Float8BlockScaling
    except Exception as e:  # noqa: BLE001 - not installed, or the core library does not load
        return None, "TE not installed" if isinstance(e, ImportError) else f"TE import failed: {type(e).__name__}: {str(e)[:120]}"


def te_autocast(te, recipe):
    """`te.autocast(recipe=...)` (TE >= 2.8) or the older `te.fp8_autocast(fp8_recipe=...)`."""
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cm = (
                te.autocast(enabled=True, recipe=recipe)
                if hasattr(te, "autocast")
                else te.fp8_autocast(enabled=True, fp8_recipe=recipe)
            )
            with cm:
                yield

    return ctx


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_linear(mod, x, dy, ref, ctx, bound):
    """One forward+backward of `mod` against FP32 references (y, dX, dW): relative errors, and where dW went.

    dW is read from `weight.main_grad` (its change) when the module accumulated there, else from `weight.grad`.
    Raises when an error exceeds `bound` or nothing is finite: a variant is timed only after this passes."""
    w = mod.weight
    mg = getattr(w, "main_grad", None)
    before = mg.clone() if mg is not None else None
    w.grad = None
    x1 = x.detach().clone().requires_grad_(True)
    with ctx():
        y = mod(x1)
    y.backward(dy)
    torch.cuda.synchronize()
    grad = w.grad if (w.grad is not None and w.grad.numel() and bool(w.grad.detach().ne(0).any())) else None
    delta = (mg - before) if mg is not None else None
    if delta is not None and not bool(delta.ne(0).any()):
        delta = None
    where = "main_grad" if delta is not None else "weight.grad" if grad is not None else "nowhere"
    if delta is not None and grad is not None:
        where = "main_grad AND weight.grad (counted twice under DDP)"
    dw = delta if delta is not None else grad
    errs = {
        "y": rel_err(y, ref["y"]),
        "dx": rel_err(x1.grad, ref["dx"]),
        "dw": rel_err(dw, ref["dw"]) if dw is not None else float("inf"),
    }
    w.grad = None
    bad = {k: v for k, v in errs.items() if not v <= bound}
    if bad:
        raise RuntimeError(f"wrong result (relative error vs FP32 {bad}, bound {bound}; dW went to {where})")
    return errs, where


def deepgemm_ceiling(dg, m, n, k, check=True):
    """The three DeepGEMM GEMMs of one FP8 linear fwd+bwd on pre-quantized operands (ms each): FProp 1D2D
    X[M,K].W[N,K], DGrad 1D2D dY[M,N].W^T[K,N], WGrad 1D1D dY^T[N,M].X^T[K,M] accumulated into FP32 (c = d).
    Scales in the layout DeepGEMM wants (MN-major 1x128, TMA-aligned) before timing: nothing but the GEMMs runs."""
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02
    dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16, generator=g) * 0.01

    def q1(t):  # 1x128 along the last dim, any layout the reference gives
        return quantize_blockwise(t.contiguous(), (1, 128), check_finite=False)

    mn_major = getattr(dg, "get_mn_major_tma_aligned_tensor", None) or (lambda s: s.t().contiguous().t())
    x_q, x_s = q1(x)
    w_q, w_s = quantize_blockwise(w, (128, 128), check_finite=False)
    wt_q, wt_s = quantize_blockwise(w.t().contiguous(), (128, 128), check_finite=False)
    dy_q, dy_s = q1(dy)
    dyt_q, dyt_s = q1(dy.t())
    xt_q, xt_s = q1(x.t())
    del x, w, dy
    ops = {
        "fprop": ((x_q, x_s), (w_q, w_s.contiguous()), torch.empty(m, n, device=DEV, dtype=torch.bfloat16), None, (128, 128)),
        "dgrad": ((dy_q, dy_s), (wt_q, wt_s.contiguous()), torch.empty(m, k, device=DEV, dtype=torch.bfloat16), None, (128, 128)),
        "wgrad": ((dyt_q, dyt_s), (xt_q, xt_s), torch.zeros(n, k, device=DEV, dtype=torch.float32), (1, 1, 128), (1, 128)),
    }
    # compiled_dims as megatron_jetrl.fp8.backends passes them (the same JIT kernels): "nk" (DeepGEMM's default) for
    # 1D2D, "mn" for the 1D1D WGrad
    out = {}
    for name, ((a, sa), (b, sb), d, recipe, b_block) in ops.items():
        sa_l = mn_major(sa)
        sb_l = mn_major(sb) if b_block == (1, 128) else sb
        kw = dict(c=d, recipe=recipe, compiled_dims="mn") if recipe else {}

        def call(a=a, sa_l=sa_l, b=b, sb_l=sb_l, d=d, kw=kw):
            dg.fp8_gemm_nt((a, sa_l), (b, sb_l), d, disable_ue8m0_cast=True, **kw)

        if check:
            d.zero_()
            call()
            torch.cuda.synchronize()
            rows = min(256, a.shape[0])
            want = gemm_emulated(a[:rows], sa[:rows], b, sb, b_block, torch.float64)
            err = ((d[:rows].double() - want).norm() / want.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"DeepGEMM {name} is wrong: relative error {err:.3g} against the emulated GEMM")
            out[f"{name}_err"] = err
        out[f"{name}_ms"] = bench(call)
    out["ms"] = out["fprop_ms"] + out["dgrad_ms"] + out["wgrad_ms"]
    return out


def linear_section(res, m=8192, te_fused=True):
    """Qwen3-8B's four linears at M tokens, forward+backward, against BF16 nn.Linear (plain autograd).

    FP8 variants get `weight.main_grad` (FP32 zeros, what megatron DDP attaches): with the DeepGEMM backend the
    WGrad accumulates into it and returns no separate dW. Inputs x (grad on) and dY are rotated over two sets;
    grads of x and weight are reset outside the timed region each iteration (triton do_bench)."""
    flows = {"ours": shipped_flow(), "ours_cublaslt": PrecisionFlow(mode="jetrl", backend="cublaslt")}
    te, te_recipe = import_te()
    dg = import_deep_gemm()
    notes = [
        "BF16 = torch.nn.Linear, plain autograd (dW into weight.grad, BF16)",
        f"ours = FP8Linear + PrecisionFlow(mode='jetrl') shipped defaults ({describe_flow(flows['ours'])}), weight.main_grad attached (FP32, as megatron DDP)",
        f"ours_cublaslt = the same with backend='cublaslt' ({describe_flow(flows['ours_cublaslt'])}), weight.main_grad attached",
        "TE = te.Linear(params_dtype=bf16) under Float8BlockScaling()"
        + (
            f", NVTE_FP8_BLOCK_SCALING_FP32_SCALES={os.environ.get('NVTE_FP8_BLOCK_SCALING_FP32_SCALES')}"
            if te
            else f": {te_recipe}"
        ),
        "TE_fused = te.Linear(fuse_wgrad_accumulation=True) with weight.main_grad (megatron's gradient_accumulation_fusion)",
        "ceiling = DeepGEMM GEMMs only: FProp 1D2D + DGrad 1D2D + WGrad 1D1D FP32-accumulate on pre-quantized operands"
        + ("" if dg else ": DeepGEMM not installed"),
    ]
    print(f"linear forward+backward, Qwen3-8B shapes, M={m} (ms; ratio = BF16 ms / variant ms):", flush=True)
    for n_ in notes:
        print("  - " + n_, flush=True)
    cols = ["ours", "ours_cublaslt", "te", "te_fused", "ceiling"]
    rows = []
    for name, (n, k) in linear_shapes("Qwen3-8B").items():
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
        xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2)]
        dys = [torch.randn(m, n, device=DEV, dtype=torch.bfloat16) * 0.01 for _ in range(2)]
        sets = list(zip(xs, dys))
        wf, x0, dy0 = lin.weight.detach().float(), xs[0].detach().float(), dys[0].float()
        ref = {"y": x0 @ wf.t(), "dx": dy0 @ wf, "dw": dy0.t() @ x0}
        del wf, x0, dy0
        row = {"linear": name, "M": m, "N": n, "K": k}
        no_ctx = contextlib.nullcontext

        def run(label, mod, ctx=no_ctx, bound=0.1):
            try:
                errs, where = check_linear(mod, xs[0], dys[0], ref, ctx, bound)

                def step(x, dy):
                    with ctx():
                        y = mod(x)
                    y.backward(dy)

                t = bench(rotating(step, sets), grad_to_none=[*xs, mod.weight])
                row[f"{label}_ms"], row[f"{label}_err"], row[f"{label}_dw_to"] = t, errs, where
            except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                row[f"{label}_ms"] = None
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"    {name} {label}: {row[f'{label}_error']}", flush=True)

        run("bf16", lin, bound=0.02)
        for label, fl in flows.items():
            try:
                mod = FP8Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16, flow=fl)
                mod.load_state_dict(lin.state_dict())
                mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)
            except Exception as e:  # noqa: BLE001
                row[f"{label}_ms"], row[f"{label}_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
                continue
            run(label, mod)
            del mod
        if te is None:
            row["te_ms"] = row["te_fused_ms"] = None
            row["te_error"] = row["te_fused_error"] = te_recipe
        else:
            for label, fused in (("te", False), ("te_fused", True)):
                if fused and not te_fused:
                    continue
                try:
                    mod = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=DEV, fuse_wgrad_accumulation=fused)
                    with torch.no_grad():
                        mod.weight.copy_(lin.weight)
                    if fused:
                        mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)
                except Exception as e:  # noqa: BLE001
                    row[f"{label}_ms"], row[f"{label}_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                run(label, mod, ctx=te_autocast(te, te_recipe()))
                del mod
        if dg is None:
            row["ceiling_ms"], row["ceiling_error"] = None, "DeepGEMM not installed"
        else:
            try:
                c = deepgemm_ceiling(dg, m, n, k)
                row["ceiling_ms"] = c["ms"]
                row["ceiling"] = c
            except Exception as e:  # noqa: BLE001
                row["ceiling_ms"], row["ceiling_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
                print(f"    {name} ceiling: {row['ceiling_error']}", flush=True)
        for c_ in cols:
            if row.get(f"{c_}_ms") and row.get("bf16_ms"):
                row[f"{c_}_ratio"] = row["bf16_ms"] / row[f"{c_}_ms"]
        rows.append(row)
        print(
            f"  {name:8s} N={n:5d} K={k:5d}  bf16 {_fmt_ms(row.get('bf16_ms'))}  "
            + "  ".join(f"{c_} {_cell(row, c_)}" for c_ in cols),
            flush=True,
        )
        del lin, xs, dys, sets, ref
        torch.cuda.empty_cache()
    total = {"linear": "all four", "M": m}
    for c_ in ["bf16"] + cols:
        vals = [r.get(f"{c_}_ms") for r in rows]
        total[f"{c_}_ms"] = sum(vals) if vals and all(v for v in vals) else None
        if c_ != "bf16" and total[f"{c_}_ms"] and total["bf16_ms"]:
            total[f"{c_}_ratio"] = total["bf16_ms"] / total[f"{c_}_ms"]
    for c_ in cols:  # a column that failed everywhere carries its reason into the table
        errs = {r.get(f"{c_}_error") for r in rows} - {None}
        if errs and total.get(f"{c_}_ms") is None:
            total[f"{c_}_error"] = sorted(errs)[0]
    res["linear"] = rows
    res["linear_total"] = total
    res["linear_notes"] = notes
    print_linear_table(rows + [total], cols, notes)
    linear_targets(res)


def _fmt_ms(v):
    return f"{v:.3f}" if v else "-"


def _cell(row, col):
    if row.get(f"{col}_ms"):
        return f"{row[f'{col}_ms']:.3f} ({row[f'{col}_ratio']:.2f}x)" if row.get(f"{col}_ratio") else f"{row[f'{col}_ms']:.3f}"
    err = row.get(f"{col}_error") or "failed"
    return err if err in ("TE not installed", "DeepGEMM not installed") else f"n/a ({err[:60]})"


def print_linear_table(rows, cols, notes):
    heads = {
        "ours": "ours, shipped defaults",
        "ours_cublaslt": "ours, backend=cublaslt",
        "te": "TE 2.20.2 te.Linear Float8BlockScaling",
        "te_fused": "TE, fuse_wgrad_accumulation",
        "ceiling": "DeepGEMM GEMMs only (ceiling)",
    }
    print(
        f"\n| Qwen3-8B linear, M={rows[0]['M']}, fwd+bwd | BF16 nn.Linear ms | "
        + " | ".join(f"{heads[c]} ms (ratio)" for c in cols)
        + " |"
    )
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        label = f"{r['linear']} (N={r['N']}, K={r['K']})" if "N" in r else "**all four**"
        print(f"| {label} | {_fmt_ms(r.get('bf16_ms'))} | " + " | ".join(_cell(r, c) for c in cols) + " |")
    print("\nNotes: " + "; ".join(notes) + ".", flush=True)


def linear_targets(res):
    rows, tot = res.get("linear", []), res.get("linear_total", {})
    if not rows:
        return
    ratios = [r.get("ours_ratio") for r in rows]
    s = tot.get("ours_ratio")
    each_ok = all(x is not None and x >= LINEAR_TARGETS["each"] for x in ratios)
    print(
        f"target: sum of the four linears >= {LINEAR_TARGETS['sum']}x with shipped defaults: "
        f"{f'{s:.2f}x' if s else 'n/a'} -> {'MET' if s and s >= LINEAR_TARGETS['sum'] else 'NOT MET'}"
    )
    print(
        f"target: no single linear < {LINEAR_TARGETS['each']}x: "
        + ", ".join(f"{r['linear']} {f'{x:.2f}x' if x else 'n/a'}" for r, x in zip(rows, ratios))
        + f" -> {'MET' if each_ok else 'NOT MET'}"
    )
    if tot.get("ceiling_ratio"):
        print(
            f"ceiling (DeepGEMM GEMMs only): {tot['ceiling_ratio']:.2f}x; shipped defaults reach "
            f"{100 * tot['ceiling_ms'] / tot['ours_ms']:.0f}% of it"
            if tot.get("ours_ms")
            else "",
            flush=True,
        )
    copy = (res.get("ceilings") or {}).get("copy_GBps")
    if copy and all(r.get("ceiling_ms") and r.get("bf16_ms") for r in rows):
        linear_floor(rows, tot, copy)


def recipe_quant_bytes(m: int, n: int, k: int) -> int:
    """Bytes the recipe's quantization must move in one fwd+bwd of a linear x[m, k] -> y[m, n] (weights excluded:
    quantized once per optimizer step), FP32 scales included:
      X   forward: BF16 read, 1x128 E4M3 rows written (FProp); backward: those rows and scales read back and
          re-quantized along tokens (WGrad's 128x1 groups of the dequantized activation, the quantizer contract);
      dY  backward: BF16 read, 1x128 rows (DGrad) and 128x1 token groups (WGrad) written in one pass."""

    def scales(rows, cols):  # 1x128 row scales + 128x1 token-group scales of a [rows, cols] tensor
        return 4 * rows * -(-cols // 128), 4 * cols * -(-rows // 128)

    xr, xc = scales(m, k)
    dr, dc = scales(m, n)
    x = 2 * m * k + m * k + xr + (m * k + xr) + m * k + xc
    dy = 2 * m * n + 2 * m * n + dr + dc
    return x + dy


def linear_floor(rows, tot, copy_gbps: float) -> None:
    """The floor of the FP8 linear on this GPU: DeepGEMM's GEMMs (the ceiling column) plus the recipe's quantization
    bytes at the device copy rate, with nothing else (no launch, no overlap). A target above its floor ratio is
    out of reach of any change to quantization, copies or host work; only faster GEMMs move it."""
    total_ms = 0.0
    parts = []
    for r in rows:
        ms = r["ceiling_ms"] + recipe_quant_bytes(r["M"], r["N"], r["K"]) / copy_gbps / 1e6
        r["floor_ms"], r["floor_ratio"] = ms, r["bf16_ms"] / ms
        total_ms += ms
        parts.append(f"{r['linear']} {r['floor_ratio']:.2f}x")
    tot["floor_ms"], tot["floor_ratio"] = total_ms, tot["bf16_ms"] / total_ms
    share = f"; shipped defaults reach {100 * total_ms / tot['ours_ms']:.0f}% of it" if tot.get("ours_ms") else ""
    print(
        f"floor (DeepGEMM GEMMs + the recipe's quantization bytes at {copy_gbps:.0f} GB/s): {', '.join(parts)}; "
        f"sum {tot['floor_ratio']:.2f}x ({total_ms:.3f} ms){share}",
        flush=True,
    )


# ---- profile: where the time of the FP8 linear goes ---------------------------------------------------

PROFILE_CATEGORIES = (  # (category, kernel-name substrings), first match wins; names compared lower-case
    ("quantize", ("quant", "swiglu_bwd_tile")),
    ("GEMM deepgemm", ("fp8_gemm_1d", "sm90_fp8_gemm", "deep_gemm", "deepgemm")),
    ("GEMM triton", ("_gemm_tma", "_gemm_ptr")),
    ("GEMM cuBLAS", ("nvjet", "xmma", "cublas", "cutlass", "gemm", "sm90_")),
    ("copy/fill/pad/layout", ("copy", "memcpy", "memset", "fill", "zero", "pad", "cat", "transpose", "tma_aligned", "ue8m0")),
    ("elementwise/reduce", ("elementwise", "reduce", "unrolled", "vectorized")),
)


def categorize(kernel: str) -> str:
    low = kernel.lower()
    return next((c for c, keys in PROFILE_CATEGORIES if any(k in low for k in keys)), "other")


def timeline(intervals: list[tuple[int, int, str]], passes: int, top: int = 6, skip: int = 0) -> dict:
    """Where the GPU sat idle, read off the kernel timeline itself (not wall minus kernel sum, which mixes in what
    differs between the timed and the profiled runs, L2 flushes for one). `intervals`: (start_ns, end_ns, kernel) of
    every kernel of `passes` back-to-back passes after the first `skip` passes (left out: a pass issued into an empty
    queue waits for the host at every launch, which the steady state never does). Per pass: the span from the first
    start to the last end, the time some kernel ran (overlaps merged), their difference (the idle time), and the
    largest idle stretches summed by the kernel that ended them (the launch that came late)."""
    if not intervals or passes < 1 or len(intervals) % (passes + skip):
        raise ValueError(
            f"timeline needs the same kernels in each of at least one pass, got {len(intervals)} kernels "
            f"for {passes} + {skip} passes"
        )
    ivs = sorted(intervals)[len(intervals) // (passes + skip) * skip :]
    busy, idle_before = 0, {}
    cur_start, cur_end = ivs[0][0], ivs[0][1]
    for start, end, name in ivs[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            idle_before[name] = idle_before.get(name, 0) + start - cur_end
            cur_start = start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - ivs[0][0]
    worst = sorted(idle_before.items(), key=lambda kv: -kv[1])[:top]
    return {
        "span_ms": span / passes / 1e6,
        "busy_ms": busy / passes / 1e6,
        "idle_ms": (span - busy) / passes / 1e6,
        "idle_before": [[k, ns / passes / 1e6] for k, ns in worst],
    }


def kernel_intervals(prof) -> list[tuple[int, int, str]]:
    """(start_ns, end_ns, name) of every CUDA kernel a torch.profiler run recorded (memcpy/memset included)."""
    from torch.autograd import DeviceType

    return [
        (e.start_ns(), e.end_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA and e.end_ns() > e.start_ns()
    ]


def profile_section(res, m=8192, iters=5):
    """torch.profiler over `iters` forward+backward passes of the four FP8 linears (shipped defaults,
    main_grad attached): GPU time per kernel and category per pass, against the wall time and the DeepGEMM ceiling."""
    from torch.profiler import ProfilerActivity, profile

    flow = shipped_flow()
    print(
        f"profile: the four Qwen3-8B FP8 linears fwd+bwd, M={m}, shipped defaults ({describe_flow(flow)}), {iters} passes:",
        flush=True,
    )
    mods, sets = [], []
    for name, (n, k) in linear_shapes("Qwen3-8B").items():
        mod = FP8Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16, flow=flow)
        with torch.no_grad():
            mod.weight.normal_(0, 0.02)
        mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)
        mods.append((name, mod))
        sets.append(
            (
                torch.randn(m, k, device=DEV, dtype=torch.bfloat16).requires_grad_(True),
                torch.randn(m, n, device=DEV, dtype=torch.bfloat16) * 0.01,
            )
        )

    def one_pass():
        for (_, mod), (x, dy) in zip(mods, sets):
            x.grad = None
            mod.weight.grad = None
            mod(x).backward(dy)

    one_pass()  # compile / warm
    torch.cuda.synchronize()
    wall = bench(one_pass)
    cuda = torch.device(DEV).type == "cuda"
    host = []  # host time to issue each pass; passes after the first find the GPU still busy with earlier ones
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters + 1):  # the first pass starts from an empty queue: the timeline leaves it out
            t0 = time.perf_counter()
            one_pass()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    host_ms = sorted(host[1:])[iters // 2]
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda:  # kernels (CUPTI events)
            us = ev.device_time_total if str(ev.device_type).endswith("CUDA") else 0.0
        else:  # a CPU dry run of this code: aten ops' own time
            us = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0.0
        if us:
            kernels[ev.key] = kernels.get(ev.key, 0.0) + us / 1e3 / (iters + 1)
    by_cat: dict[str, list] = {}
    for k_, ms in kernels.items():
        by_cat.setdefault(categorize(k_), []).append((k_, ms))
    kernel_sum = sum(kernels.values())
    ceiling = (res.get("linear_total") or {}).get("ceiling_ms")
    if ceiling is None:
        dg = import_deep_gemm()
        if dg is not None:
            try:
                ceiling = sum(deepgemm_ceiling(dg, m, n, k, check=False)["ms"] for n, k in linear_shapes("Qwen3-8B").values())
            except Exception as e:  # noqa: BLE001
                print(f"  ceiling failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print("\n| category | kernel | ms per pass (4 linears fwd+bwd) | % of wall |")
    print("|---|---|---|---|")
    table = []
    for cat in sorted(by_cat, key=lambda c: -sum(ms for _, ms in by_cat[c])):
        ks = sorted(by_cat[cat], key=lambda kv: -kv[1])
        tot = sum(ms for _, ms in ks)
        print(f"| **{cat}** | ({len(ks)} kernels) | **{tot:.3f}** | {100 * tot / wall:.1f}% |")
        for k_, ms in ks[:8]:
            print(f"| | `{k_[:90]}` | {ms:.3f} | {100 * ms / wall:.1f}% |")
        table.append({"category": cat, "ms": tot, "kernels": [[k_, ms] for k_, ms in ks]})
    idle = wall - kernel_sum
    print(
        f"| **no kernel running** (launch gaps, host work, syncs; and L2: the timed wall flushes it per pass, the profiled "
        f"kernels run warm; the timeline below measures the gaps themselves) | wall - sum of kernels | **{idle:.3f}** | {100 * idle / wall:.1f}% |"
    )
    print(f"| **wall** (do_bench median of one pass) | | **{wall:.3f}** | 100% |")
    gap = {}
    if ceiling:
        gemm = sum(t["ms"] for t in table if t["category"].startswith("GEMM"))
        gap = {
            "wall_ms": wall,
            "ceiling_ms": ceiling,
            "gap_ms": wall - ceiling,
            "gemm_over_ceiling_ms": gemm - ceiling,
            **{f"{t['category']}_ms": t["ms"] for t in table if not t["category"].startswith("GEMM")},
            "idle_ms": idle,
        }
        print(
            f"\ngap from the DeepGEMM GEMMs-only ceiling: wall {wall:.3f} ms - ceiling {ceiling:.3f} ms = {wall - ceiling:.3f} ms, of which:"
        )
        print(
            f"  GEMM kernels above the ceiling's GEMM time (other backend, layouts, no L2 flush here): {gemm - ceiling:+.3f} ms"
        )
        for t in table:
            if not t["category"].startswith("GEMM"):
                print(f"  {t['category']}: {t['ms']:.3f} ms")
        print(f"  no kernel running: {idle:.3f} ms", flush=True)
    intervals = kernel_intervals(prof) if cuda else []
    try:
        tl = timeline(intervals, iters, skip=1) if cuda else None
    except ValueError as e:  # a pass with other kernels than the rest: nothing to compare per pass
        tl = None
        print(f"timeline: {e}", flush=True)
    if tl:
        tl["idle_ms_with_first_pass"] = timeline(intervals, iters + 1)["idle_ms"]
        print(
            f"timeline of {iters} passes issued behind a first one, per pass: GPU span {tl['span_ms']:.3f} ms, some kernel running "
            f"{tl['busy_ms']:.3f} ms, idle {tl['idle_ms']:.3f} ms; host time to issue one pass {host_ms:.3f} ms "
            f"({'host-bound' if host_ms > tl['span_ms'] else 'the GPU is the bottleneck'}); counting the first pass (issued into an "
            f"empty queue) too: idle {tl['idle_ms_with_first_pass']:.3f} ms per pass"
        )
        print(
            "  idle stretches by the kernel that ended them: "
            + "; ".join(f"`{k[:120]}` {ms:.3f} ms" for k, ms in tl["idle_before"]),
            flush=True,
        )
    res["profile"] = {
        "M": m,
        "iters": iters,
        "flow": describe_flow(flow),
        "wall_ms": wall,
        "kernel_sum_ms": kernel_sum,
        "categories": table,
        "gap": gap,
        "timeline": tl,
        "host_issue_ms": host_ms,
    }
    del mods, sets
    torch.cuda.empty_cache()


class RMSNorm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h, device=DEV, dtype=torch.bfloat16))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class Layer(torch.nn.Module):
    """A Qwen3-8B decoder layer without RoPE/q-k norms: RMSNorm, QKV, SDPA (GQA, causal, BF16), O, RMSNorm, SwiGLU MLP."""

    def __init__(self, model, flow=None):
        super().__init__()
        h, inter, qh, kvh, d = MODELS[model]
        self.h, self.inter, self.qh, self.kvh, self.d = h, inter, qh, kvh, d

        def lin(i, o):
            if flow is None:
                return torch.nn.Linear(i, o, bias=False, device=DEV, dtype=torch.bfloat16)
            return FP8Linear(i, o, bias=False, flow=flow, device=DEV, dtype=torch.bfloat16)

        self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
        self.qkv, self.o = lin(h, (qh + 2 * kvh) * d), lin(qh * d, h)
        self.gate_up, self.down = lin(h, 2 * inter), lin(inter, h)

    def forward(self, x):  # x [B, S, H]
        b, s, _ = x.shape
        qkv = self.qkv(self.n1(x))
        q, k, v = qkv.split([self.qh * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = q.view(b, s, self.qh, self.d).transpose(1, 2)
        k = k.view(b, s, self.kvh, self.d).transpose(1, 2)
        v = v.view(b, s, self.kvh, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.gate_up(self.n2(x)).split(self.inter, dim=-1)
        return x + self.down(F.silu(g) * u)


def attach_main_grads(module):
    """`main_grad` (FP32 zeros) on every FP8Linear weight, as megatron DDP attaches it."""
    for m in module.modules():
        if isinstance(m, FP8Linear):
            m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)


def layer_section(res, model="Qwen3-8B", batch=2, seq=4096):
    print(
        f"one {model} decoder layer forward+backward, {batch}x{seq} tokens (attention BF16 SDPA, linears FP8; "
        "BF16 = nn.Linear with plain autograd; FP8 weights carry main_grad as under megatron DDP):",
        flush=True,
    )
    torch.manual_seed(0)
    ref = Layer(model)
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0, 0.02)
    xs = [torch.randn(batch, seq, MODELS[model][0], device=DEV, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2)]
    dys = [torch.randn_like(x) * 0.01 for x in xs]
    sets = list(zip(xs, dys))

    def step(mod):
        return rotating(lambda x, dy: mod(x).backward(dy), sets)

    def grads_none(mod):
        return [*xs, *mod.parameters()]

    x0 = xs[0].detach().clone().requires_grad_(True)
    y_ref = ref(x0)
    y_ref.backward(dys[0])
    y_ref, dx_ref = y_ref.detach().float(), x0.grad.float()
    t_bf = bench(step(ref), grad_to_none=grads_none(ref))
    row = {"model": model, "tokens": batch * seq, "bf16_ms": t_bf, "variants": {}}
    variants = {
        "jetrl (shipped defaults)": shipped_flow,
        "jetrl backend=cublaslt": lambda: PrecisionFlow(mode="jetrl", backend="cublaslt"),
    }
    for label, make in variants.items():
        v = {}
        try:
            flow = make()
            v["flow"] = describe_flow(flow)
            lay = Layer(model, flow=flow)
            lay.load_state_dict(ref.state_dict())
            attach_main_grads(lay)
            x1 = xs[0].detach().clone().requires_grad_(True)
            y = lay(x1)
            y.backward(dys[0])
            # errors of what the layer adds (y - x) and of its gradient's non-identity part (dx - dy): the residual
            # stream alone would hide a wrong branch
            v["err_y"] = rel_err(y.detach().float() - x0.detach().float(), y_ref - x0.detach().float())
            v["err_dx"] = rel_err(x1.grad.float() - dys[0].float(), dx_ref - dys[0].float())
            if not (v["err_y"] < 0.3 and v["err_dx"] < 0.4):  # FP8 noise of the branch ~0.05-0.1; a wrong GEMM ~1
                raise RuntimeError(
                    f"wrong result: relative error vs the BF16 layer y-x {v['err_y']:.3g}, dx-dy {v['err_dx']:.3g}"
                )
            del y, x1
            t = bench(step(lay), grad_to_none=grads_none(lay))
            v["ms"], v["ratio"] = t, t_bf / t
            del lay
        except Exception as e:  # noqa: BLE001 - reported in the row
            v["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["variants"][label] = v
        torch.cuda.empty_cache()
    print(
        f"  bf16 {t_bf:.3f} ms  "
        + "  ".join(
            f"{k}: "
            + (f"{v['ms']:.3f} ms ({v['ratio']:.2f}x, err y {v['err_y']:.3f})" if "ms" in v else f"n/a ({v.get('error')})")
            for k, v in row["variants"].items()
        ),
        flush=True,
    )
    shipped = row["variants"]["jetrl (shipped defaults)"]
    r = shipped.get("ratio")
    print(
        f"target: decoder layer fwd+bwd >= {LINEAR_TARGETS['layer']}x with shipped defaults: "
        f"{f'{r:.2f}x' if r else 'n/a'} -> {'MET' if r and r >= LINEAR_TARGETS['layer'] else 'NOT MET'}",
        flush=True,
    )
    res["layer"] = row


def summary(res, backends):
    print("\n=== summary (ratios from this run) ===")
    g = [r for r in res.get("gemm", []) if r["model"] == "Qwen3-8B" and " " not in r["linear"]]
    for be in backends:
        if g:
            rs = [r[f"{be}_ratio"] for r in g]
            print(
                f"GEMM {be:9s} 8B fprop shapes (12): min {min(rs):.2f}x  geo-mean {math.exp(sum(map(math.log, rs)) / len(rs)):.2f}x  max {max(rs):.2f}x  (target >= 1.6x)"
            )
    for r in res.get("quant", []):
        if not r["kernel"].startswith("sweep") and "pct_copy" in r:
            print(f"quant {r['kernel']:44s} {r['pct_copy']:5.1f}% of copy (target >= 80%)")
    if res.get("linear"):
        tot = res["linear_total"]
        for c in ("ours", "ours_cublaslt", "te", "te_fused", "ceiling"):
            if tot.get(f"{c}_ratio"):
                print(f"linear fwd+bwd {c:14s} 8B, M={tot['M']}, sum of 4 linears: {tot[f'{c}_ratio']:.2f}x")
        linear_targets(res)
    if res.get("layer"):
        for k, v in res["layer"]["variants"].items():
            print(f"decoder layer fwd+bwd {k}: " + (f"{v['ratio']:.2f}x" if "ratio" in v else f"n/a ({v.get('error')})"))
    if res.get("profile", {}).get("gap"):
        gp = res["profile"]["gap"]
        print(f"profile: wall {gp['wall_ms']:.3f} ms vs DeepGEMM ceiling {gp['ceiling_ms']:.3f} ms (gap {gp['gap_ms']:.3f} ms)")


SECTIONS = ("ceilings", "quant", "gemm", "linear", "layer", "profile")
DEFAULT_SECTIONS = "ceilings,quant,gemm,linear,layer"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_fp8.json"))
    ap.add_argument("--sweep", nargs="?", const="gemm,quant", default="", help="also time Triton launch configs: gemm,quant")
    ap.add_argument(
        "--sections",
        nargs="+",
        default=[DEFAULT_SECTIONS],
        help=f"space- or comma-separated, any of {', '.join(SECTIONS)} (default: {DEFAULT_SECTIONS})",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="M values of the gemm section")
    ap.add_argument("--linear-m", type=int, default=8192, help="tokens M of the linear and profile sections")
    ap.add_argument("--profile-iters", type=int, default=5)
    ap.add_argument("--no-te-fused", action="store_true", help="skip the TE fuse_wgrad_accumulation column")
    ap.add_argument("--backends", default="", help="gemm/quant sections: comma list; default: every fast backend available")
    args = ap.parse_args(argv)
    args.sections = [s for item in args.sections for s in item.split(",") if s]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if args.linear_m <= 0 or args.linear_m % 128:
        ap.error(f"--linear-m must be a positive multiple of 128, got {args.linear_m}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "error: tools/bench/bench_fp8.py needs a CUDA GPU (sm90 for DeepGEMM/cuBLASLt) and none is visible here; "
            "run it on the GPU machine (bash tools/gpu/gpu_fp8.sh bench)",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("error: tools/bench/bench_fp8.py needs Triton (triton.testing.do_bench)", file=sys.stderr)
        return 2
    sections = args.sections
    torch.backends.cuda.matmul.allow_tf32 = False
    backends = args.backends.split(",") if args.backends else [b for b in available_backends(DEV) if b != "emulated"]
    res = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "sections": sections,
        "backends": backends,
        "shipped_flow": describe_flow(shipped_flow()),
        "gemm_config": {k: list(v) for k, v in getattr(K, "GEMM_CONFIG", {}).items()},
    }
    dg = import_deep_gemm()
    res["deep_gemm"] = getattr(dg, "__version__", "?") if dg else None
    print(
        f"{res['date']}  {res['gpu']}  torch {res['torch']}  triton {res['triton']}  backends {backends}  "
        f"DeepGEMM {res['deep_gemm']}  shipped flow: {res['shipped_flow']}",
        flush=True,
    )

    def save():
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)

    copy_gbs = ceilings(res) if "ceilings" in sections else 4.2e3
    if "gemm" in args.sweep:
        gemm_sweep(res)
    for name, fn in (
        ("quant", lambda: quant_section(res, copy_gbs, "quant" in args.sweep)),
        ("gemm", lambda: gemm_section(res, backends, args.models.split(","), tuple(int(m) for m in args.ms.split(",")))),
        ("linear", lambda: linear_section(res, args.linear_m, te_fused=not args.no_te_fused)),
        ("layer", lambda: layer_section(res)),
        ("profile", lambda: profile_section(res, args.linear_m, args.profile_iters)),
    ):
        if name in sections:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the other sections still run; the JSON says what failed
                import traceback

                traceback.print_exc()
                res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
            save()
            torch.cuda.empty_cache()
    summary(res, backends)
    save()
    print(f"wrote {args.json}")
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
