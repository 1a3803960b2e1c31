#!/usr/bin/env python3
"""Decode-shaped GEMMs on one GPU: the linears of a Qwen3-8B decode step at M = 64 / 128 rows.

    PYTHONPATH=. python3 tools/bench/bench_decode_gemm.py [--layers 36] [--rows 64 128]

Per variant, every linear of `--layers` layers (q, k, v, o, gate, up, down; distinct weights, so nothing
stays in L2) is captured in one CUDA graph and replayed; the table gives ms per replay and the weight bytes
read per second. Inputs are quantized once up front for the FP8 GEMM-only rows; "quantize" is the 1x128
activation quantizer the engine adds (once for q/k/v, o, gate/up, down). Each FP8 variant is checked
against the emulated GEMM (relative error) on the first layer's q weight.

Results and reading: BENCHMARKS.md, "What does not help". A split-K Triton variant (K blocks spread over
programs, FP32 partials summed in order) was measured with this script at commit 091d2f7 and removed: it
only tied cuBLASLt at M = 64 and lost at M = 128.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_jetrl.fp8 import kernels  # noqa: E402
from megatron_jetrl.fp8.gemm import blockwise_gemm, gemm_emulated  # noqa: E402
from megatron_jetrl.fp8.quant import quantize_blockwise  # noqa: E402
from tools.bench.common import graphed  # noqa: E402

H, I, KV = 4096, 12288, 1024
SHAPES = [("q", H, H), ("k", KV, H), ("v", KV, H), ("o", H, H), ("gate", I, H), ("up", I, H), ("down", H, I)]


def graph_ms(fn, reps=20):
    replay = graphed(fn)
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf16 = [
        [(0.02 * torch.randn(n, k, device=dev, generator=g)).to(torch.bfloat16) for _, n, k in SHAPES] for _ in range(args.layers)
    ]
    fp8 = [[quantize_blockwise(w, (128, 128), check_finite=False) for w in layer] for layer in bf16]
    gb16 = sum(w.numel() * 2 for layer in bf16 for w in layer) / 1e9
    gb8 = sum(q.numel() + s.numel() * 4 for layer in fp8 for q, s in layer) / 1e9
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.layers} layers: BF16 weights {gb16:.2f} GB, FP8 {gb8:.2f} GB"
    )
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for k in (H, I)}
        xq = {k: kernels.quantize_1x128(x, check_finite=False) for k, x in xs.items()}
        q0, s0 = fp8[0][0]
        want = gemm_emulated(*xq[H], q0, s0, (128, 128), torch.float64)

        def rel(y):
            return ((y.double() - want).norm() / want.norm()).item()

        variants = {
            "bf16 F.linear": (lambda: [F.linear(xs[k], w) for layer in bf16 for w, (_, _, k) in zip(layer, SHAPES)], gb16, None),
            "fp8 cublaslt": (
                lambda: [
                    blockwise_gemm(*xq[k], q, s, backend="cublaslt") for layer in fp8 for (q, s), (_, _, k) in zip(layer, SHAPES)
                ],
                gb8,
                rel(blockwise_gemm(*xq[H], q0, s0, backend="cublaslt", out_dtype=torch.float32)),
            ),
            "fp8 triton (128x128 tiles)": (
                lambda: [kernels.gemm(*xq[k], q, s) for layer in fp8 for (q, s), (_, _, k) in zip(layer, SHAPES)],
                gb8,
                rel(kernels.gemm(*xq[H], q0, s0, out_dtype=torch.float32)),
            ),
        }
        variants["quantize (4 per layer)"] = (
            lambda: [kernels.quantize_1x128(xs[k], check_finite=False) for _ in range(args.layers) for k in (H, H, H, I)],
            0,
            None,
        )
        for name, (fn, gb, err) in variants.items():
            try:
                ms = graph_ms(fn)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end of the run
                print(f"M={m:4d} {name:40s} FAILED {type(e).__name__}: {str(e)[:160]}")
                continue
            rows.append((m, name, ms, gb / ms if gb else None, err))
            print(
                f"M={m:4d} {name:40s} {ms:8.3f} ms"
                + (f"  {gb / ms:6.2f} TB/s" if gb else "")
                + (f"  rel err {err:.1e}" if err is not None else ""),
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
