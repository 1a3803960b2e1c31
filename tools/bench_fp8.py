#!/usr/bin/env python3
"""FP8 benchmarks on one CUDA GPU, in one go: ceilings, quantizers, GEMMs, FP8 linear, one decoder layer.

    PYTHONPATH=. python3 tools/bench_fp8.py [--json bench_fp8.json] [--sweep] [--sections ...]

Order: the two ceilings first (device copy GB/s counting read + write; BF16 GEMM TFLOP/s), then the
quantization kernels (GB/s = bytes read + written, and % of copy), blockwise GEMMs for the linear
shapes of Qwen3-8B, Qwen2.5-7B and Qwen2.5-32B at M = 4096, 8192, 16384 (TFLOP/s and ratio to BF16
torch.mm on the same shape), the FP8 linear forward+backward against BF16 nn.Linear, and one decoder
layer (attention BF16, linears FP8) forward+backward against BF16. Times are medians of
triton.testing.do_bench (CUDA events); inputs are random (never zeros) and rotated among enough sets
to exceed 3x the L2 when one set is smaller. `--sweep` also times Triton tile configs (each checked
against the emulated reference first) and prints the best.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, blockwise_gemm, quantize_blockwise  # noqa: E402
from megatron_jetrl.fp8 import kernels as K  # noqa: E402
from megatron_jetrl.fp8.gemm import available_backends, gemm_emulated  # noqa: E402

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


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def l2_bytes():
    try:
        return torch.cuda.get_device_properties(0).L2_cache_size
    except Exception:
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
    sets = [(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), torch.randn(n_, k, device=DEV, dtype=torch.bfloat16)) for _ in range(2)]
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
        ms = bench(fn)
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "note": extra})
        print(f"  {name:44s} {ms*1e3:8.1f} us {gbs:7.0f} GB/s {100*gbs/copy_gbs:5.1f}% of copy {extra}", flush=True)

    print(f"quantization kernels on [{t_}, {n_}] (bytes = read + written):", flush=True)
    add("1x128 (bf16 in)", lambda: K.quantize_1x128(x, check_finite=False), elems * 3 + t_ * nb * 4)
    add("1x128 fused SwiGLU ([T, 2I] bf16 in)", lambda: K.swiglu_quantize_1x128(gu, check_finite=False), elems * 5 + t_ * nb * 4)
    add("dual 1x128 + 128x1^T (bf16 in)", lambda: K.quantize_dual(x, check_finite=False), elems * 4 + (t_ * nb + n_ * tb) * 4)
    add("128x1^T only (bf16 in)", lambda: K.quantize_dual(x, check_finite=False, rows=False), elems * 3 + n_ * tb * 4)
    add("128x1^T from E4M3 + 1x128 scales", lambda: K.quantize_dual(xq, check_finite=False, rows=False, x_scale=xs), elems * 2 + (t_ * nb + n_ * tb) * 4)
    add("128x128 (bf16 in)", lambda: K.quantize_128x128(w, check_finite=False), elems * 3)
    add("128x128 + transposed copy", lambda: K.quantize_128x128(w, check_finite=False, transposed=True), elems * 4)
    add("reference torch quantizer 1x128 (eager)", lambda: quantize_blockwise(x, (1, 128), check_finite=False), elems * 3 + t_ * nb * 4)
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
                    rows.append({"kernel": f"sweep 1x128 bm={bm} g={gr} w={wp}", "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "ok": ok})
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
                    rows.append({"kernel": f"sweep cols bn={bn} w={wp} trans={tr}", "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "ok": ok})
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
    (128, 128, 8, 8, 3, True), (128, 128, 8, 8, 4, True), (128, 64, 8, 4, 5, True), (128, 64, 8, 4, 4, True),
    (128, 64, 8, 4, 6, True), (128, 64, 16, 4, 5, True), (64, 128, 8, 4, 5, True), (64, 64, 8, 4, 6, True),
    (256, 64, 8, 8, 4, True), (128, 64, 8, 4, 5, False), (128, 128, 8, 8, 4, False),
    (128, 64, 8, 4, 4, True, True), (128, 128, 8, 8, 3, True, True), (256, 64, 8, 8, 3, True, True),
    (128, 64, 8, 4, 4, True, False, True), (128, 128, 8, 8, 3, True, False, True),
]


def gemm_sweep(res):
    print("triton GEMM tile sweep (BLOCK_M, BLOCK_N, GROUP_M, warps, stages, tma):", flush=True)
    out = []
    for (m, n, k, b_block, label) in [
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
            except Exception as e:  # a config that does not compile (shared memory) is skipped
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
                t = bench(rotating(lambda a, b, a_q, a_s, b_q, b_s: blockwise_gemm(a_q, a_s, b_q, b_s, b_block=bb, backend=be), sets))
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


def linear_section(res, backends, ms_list=(8192,)):
    rows = []
    print("linear forward+backward (x, W bf16; weight quantized once, cached), Qwen3-8B shapes:", flush=True)
    for name, (n, k) in linear_shapes("Qwen3-8B").items():
        for m in ms_list:
            lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
            xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2)]
            dys = [torch.randn(m, n, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
            sets = list(zip(xs, dys))

            def step(mod):
                return rotating(lambda x, dy: mod(x).backward(dy), sets)

            t_bf = bench(step(lin))
            row = {"linear": name, "M": m, "N": n, "K": k, "bf16_ms": t_bf}
            for be in backends:
                fl = FP8Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16, flow=PrecisionFlow(mode="jetrl", backend=be, check_finite=False))
                fl.load_state_dict(lin.state_dict())
                t = bench(step(fl))
                row[f"{be}_ms"] = t
                row[f"{be}_ratio"] = t_bf / t
                del fl
            fl = FP8Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16, flow=PrecisionFlow(mode="jetrl", backend=backends[0]))
            fl.load_state_dict(lin.state_dict())
            t = bench(step(fl))
            row["check_finite_ms"] = t
            rows.append(row)
            print(
                f"  {name:8s} M={m:5d} N={n:5d} K={k:5d}  bf16 {t_bf:6.3f} ms  "
                + "  ".join(f"{be} {row[be + '_ms']:6.3f} ms ({row[be + '_ratio']:.2f}x)" for be in backends)
                + f"  [{backends[0]} with check_finite: {t:6.3f} ms]",
                flush=True,
            )
            del lin, xs, dys, sets, fl
            torch.cuda.empty_cache()
    tot = {"bf16": sum(r["bf16_ms"] for r in rows)}
    for be in backends:
        tot[be] = sum(r[f"{be}_ms"] for r in rows)
        print(f"  all four 8B linears, M=8192: bf16 {tot['bf16']:.3f} ms, {be} {tot[be]:.3f} ms ({tot['bf16'] / tot[be]:.2f}x)", flush=True)
    res["linear"] = rows
    res["linear_total"] = tot


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


def layer_section(res, backends, model="Qwen3-8B", batch=2, seq=4096):
    print(f"one {model} decoder layer forward+backward, {batch}x{seq} tokens (attention BF16, linears FP8):", flush=True)
    torch.manual_seed(0)
    ref = Layer(model)
    xs = [torch.randn(batch, seq, MODELS[model][0], device=DEV, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2)]
    dys = [torch.randn_like(x) for x in xs]
    sets = list(zip(xs, dys))

    def step(mod):
        return rotating(lambda x, dy: mod(x).backward(dy), sets)

    t_bf = bench(step(ref))
    row = {"model": model, "tokens": batch * seq, "bf16_ms": t_bf}
    for be in backends:
        lay = Layer(model, flow=PrecisionFlow(mode="jetrl", backend=be, check_finite=False))
        lay.load_state_dict(ref.state_dict())
        t = bench(step(lay))
        row[f"{be}_ms"] = t
        row[f"{be}_ratio"] = t_bf / t
        del lay
    print(f"  bf16 {t_bf:.3f} ms  " + "  ".join(f"{be} {row[be + '_ms']:.3f} ms ({row[be + '_ratio']:.2f}x)" for be in backends), flush=True)
    res["layer"] = row


def summary(res, backends):
    print("\n=== summary (ratios from this run) ===")
    g = [r for r in res.get("gemm", []) if r["model"] == "Qwen3-8B" and " " not in r["linear"]]
    for be in backends:
        if g:
            rs = [r[f"{be}_ratio"] for r in g]
            print(f"GEMM {be:9s} 8B fprop shapes (12): min {min(rs):.2f}x  geo-mean {math.exp(sum(map(math.log, rs)) / len(rs)):.2f}x  max {max(rs):.2f}x  (target >= 1.6x)")
    if res.get("quant"):
        for r in res["quant"]:
            if not r["kernel"].startswith("sweep"):
                print(f"quant {r['kernel']:44s} {r['pct_copy']:5.1f}% of copy (target >= 80%)")
    if res.get("linear_total"):
        tot = res["linear_total"]
        for be in backends:
            print(f"linear fwd+bwd {be:9s} 8B, M=8192, sum of 4 linears: {tot['bf16'] / tot[be]:.2f}x  (target >= 1.4x)")
    if res.get("layer"):
        for be in backends:
            print(f"decoder layer fwd+bwd {be:9s}: {res['layer'][be + '_ratio']:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_fp8.json"))
    ap.add_argument("--sweep", nargs="?", const="gemm,quant", default="", help="also time Triton launch configs: gemm,quant")
    ap.add_argument("--sections", default="ceilings,quant,gemm,linear,layer")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--backends", default="", help="comma list; default: every fast backend available")
    args = ap.parse_args()
    sections = args.sections.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False
    backends = args.backends.split(",") if args.backends else [b for b in available_backends(DEV) if b != "emulated"]
    import triton

    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "backends": backends,
        "gemm_config": {k: list(v) for k, v in K.GEMM_CONFIG.items()},
    }
    print(f"{res['date']}  {res['gpu']}  torch {res['torch']}  triton {res['triton']}  backends {backends}", flush=True)
    copy_gbs = ceilings(res) if "ceilings" in sections else 4.2e3
    if "gemm" in args.sweep:
        gemm_sweep(res)
    if "quant" in sections:
        quant_section(res, copy_gbs, "quant" in args.sweep)
    if "gemm" in sections:
        gemm_section(res, backends, args.models.split(","), tuple(int(m) for m in args.ms.split(",")))
    if "linear" in sections:
        linear_section(res, backends)
    if "layer" in sections:
        layer_section(res, backends)
    summary(res, backends)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
