#!/usr/bin/env python3
"""The kernels `precision.exact_logprobs` adds, against what the default flow runs, at Qwen3-8B shapes on one GPU.

    PYTHONPATH=. python3 tools/bench/bench_exact.py [--json PATH]        (vLLM 0.26.0 kit; DeepGEMM from vLLM's wheel)

Three tables:
- lm_head GEMM `[M, 4096] x [151936, 4096]^T` in BF16, at decode (M = 128, 256) and logprob-pass (M = 8192) rows:
  cuBLAS (`F.linear`, the default flow), vLLM's batch-invariant persistent GEMM (`linear_batch_invariant`, what
  vLLM's lm_head runs in its batch-invariant mode) and DeepGEMM's `bf16_gemm_nt`. ms per call, and whether each
  one is batch-invariant: rows computed in calls of M = 1 ... 4096 rows (at offsets 0 and 517) against the same
  rows of the M = 8192 call, bytes compared.
- attention forward + backward, causal, 32 query / 8 KV heads, head 128, micro-batches of `--attn` rows x tokens:
  torch SDPA (flash; the default flow), FA3 forward with the backward recomputing a flash forward (as shipped
  before), and `rollout_kernels.fa3_causal_attention` (FA3 forward, flash backward from FA3's output and LSE).
  The gradient error of each against an FP64 reference on a small case.
- a sampled token's logprob over the full vocabulary at M = 8192: torch's FP32 log-softmax + gather against vLLM's
  `compute_token_logprobs` (what exact mode runs), forward and forward + backward; and the sampler's softmax over
  [256, 151936] FP32: torch's against vLLM's batch-invariant one (installed for all of `aten::softmax` in vLLM's
  batch-invariant mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

H, V = 4096, 151936
HEADS, GROUPS, D = 32, 8, 128


def ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def lm_head_variants():
    from vllm.model_executor.layers import batch_invariant as bi

    from megatron_jetrl.fp8.backends import deep_gemm_module

    out = {"cublas": F.linear, "persistent": bi.linear_batch_invariant}
    deep_gemm = deep_gemm_module()

    def deepgemm(x, w):
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        deep_gemm.bf16_gemm_nt(x, w, y)
        return y

    out["deepgemm"] = deepgemm
    return out


def bench_lm_head(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(V, H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(8192 + 517, H, generator=g, device="cuda", dtype=torch.bfloat16)
    table = []
    for name, fn in lm_head_variants().items():
        try:
            full = fn(x[:8192], w)
            full517 = fn(x[517:], w)
        except Exception as e:  # noqa: BLE001 - a variant this card or build lacks: say why, keep the others
            table.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        differ = []
        for m in (1, 3, 64, 128, 129, 256, 1000, 4096):
            for off, ref in ((0, full), (517, full517)):
                part = fn(x[off : off + m], w)
                if not torch.equal(part, ref[:m]):
                    differ.append(f"{m}@{off}")
        row = {"variant": name, "batch_invariant": not differ, "differ_at": differ[:6]}
        for m in rows:
            row[f"ms_M{m}"] = round(ms(lambda: fn(x[:m], w)), 4)
        ref = x[:64].double() @ w.double().t()
        row["max_rel_err_vs_fp64"] = float((full[:64].double() - ref).abs().max() / ref.abs().max())
        table.append(row)
        print(row, flush=True)
    return table


def _recompute_backward_attention():
    """FA3 forward, backward through a recomputed torch flash forward (the shipped variant before the LSE one)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale):
            b, s, h, d = q.shape
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
            out = flash_attn_varlen_func(
                q.reshape(b * s, h, d),
                k.reshape(b * s, -1, d),
                v.reshape(b * s, -1, d),
                max_seqlen_q=s,
                cu_seqlens_q=cu,
                max_seqlen_k=s,
                cu_seqlens_k=cu,
                softmax_scale=scale,
                causal=True,
                fa_version=3,
                num_splits=1,
            )
            ctx.save_for_backward(q, k, v)
            ctx.scale = scale
            return out.view(b, s, h, d)

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors
            with torch.enable_grad():
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=ctx.scale, enable_gqa=True)
                dq, dk, dv = torch.autograd.grad(out, (qt, kt, vt), grad.transpose(1, 2))
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None

    return lambda q, k, v, scale: Recompute.apply(q, k, v, scale)


def attention_variants():
    from megatron_jetrl.actor.rollout_kernels import fa3_causal_attention

    def sdpa(q, k, v, scale):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)

    return {"sdpa": sdpa, "fa3+recompute": _recompute_backward_attention(), "fa3+lse (shipped)": fa3_causal_attention}


def bench_attention(b, s):
    scale = D**-0.5
    table = []
    for name, fn in attention_variants().items():
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (
            torch.randn(2, 256, h, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for h in (HEADS, GROUPS, GROUPS)
        )
        out = fn(q, k, v, scale)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        qd, kd, vd = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ref_out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
        ref = torch.autograd.grad(ref_out, (qd, kd, vd), grad.double().transpose(1, 2))
        errs = [float((a.double() - r.transpose(1, 2)).abs().max() / r.abs().max()) for a, r in zip(got, ref)]
        q, k, v = (torch.randn(b, s, h, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for h in (HEADS, GROUPS, GROUPS))
        grad = torch.randn(b, s, HEADS, D, device="cuda", dtype=torch.bfloat16)
        row = {
            "variant": name,
            "fwd_ms": round(ms(lambda: fn(q.detach(), k.detach(), v.detach(), scale)), 3),
            "fwd_bwd_ms": round(ms(lambda: torch.autograd.grad(fn(q, k, v, scale), (q, k, v), grad)), 3),
            "grad_rel_err_dq_dk_dv": [f"{e:.2e}" for e in errs],
        }
        table.append(row)
        print(row, flush=True)
    return table


def bench_logprobs(m):
    from vllm.model_executor.layers import batch_invariant as bi
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    from megatron_jetrl.actor.logprobs import _ExactLogprobs

    logits = torch.randn(m, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (m,), device="cuda")

    def torch_lp(x):
        return torch.log_softmax(x.float(), dim=-1).gather(-1, targets[:, None])[:, 0]

    table = [
        {
            "op": "logprob: torch log_softmax fp32 + gather",
            "fwd_ms": ms(lambda: torch_lp(logits.detach())),
            "fwd_bwd_ms": ms(lambda: torch.autograd.grad(torch_lp(logits).sum(), logits)),
        },
        {
            "op": "logprob: vLLM compute_token_logprobs (exact)",
            "fwd_ms": ms(lambda: compute_token_logprobs(logits.detach(), targets[:, None])),
            "fwd_bwd_ms": ms(lambda: torch.autograd.grad(_ExactLogprobs.apply(logits, targets, V).sum(), logits)),
        },
    ]
    probs = torch.randn(256, V, device="cuda", dtype=torch.float32)
    table += [
        {"op": "sampler softmax [256, V] fp32: torch", "fwd_ms": ms(lambda: torch.softmax(probs, -1))},
        {
            "op": "sampler softmax [256, V] fp32: vLLM batch-invariant",
            "fwd_ms": ms(lambda: bi.softmax_batch_invariant(probs, -1)),
        },
    ]
    for row in table:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if key in row:
                row[key] = round(row[key], 3)
        print(row, flush=True)
    return table


def markdown(rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 8192], help="lm_head rows timed")
    ap.add_argument("--attn", type=int, nargs=2, default=[16, 640], metavar=("B", "S"), help="attention micro-batch")
    ap.add_argument("--json", help="write the three tables here")
    args = ap.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "lm_head": bench_lm_head(args.rows),
        "attention": bench_attention(*args.attn),
        "logprobs": bench_logprobs(8192),
    }
    for name in ("lm_head", "attention", "logprobs"):
        print(f"\n### {name} ({result['device']})\n\n{markdown(result[name])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
