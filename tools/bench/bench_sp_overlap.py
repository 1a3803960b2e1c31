#!/usr/bin/env python3
"""Sequence parallelism's four linears of a TP rank, FP8 against BF16, and how each FP8 overlap hides the communication.

    torchrun --nproc-per-node=4 tools/bench/bench_sp_overlap.py [--tokens 4352] [--reps 20] [--json PATH]
    torchrun --nproc-per-node=2 tools/bench/bench_sp_overlap.py --tiny          # CPU smoke run (gloo)

One TP group of all ranks, sequence parallelism on: Qwen3-8B's qkv and gate_up (column-parallel: the sequence gathered
first) and o and down (row-parallel: the output reduce-scattered; down's input is [gate | up], SwiGLU fused into its
quantization in FP8 and run before it in BF16), forward and backward, a micro-batch of `--tokens` tokens split over
the ranks. Variants:

* `bf16`: megatron-core's sequence-parallel linear (`linear_with_grad_accumulation_and_async_allreduce`, its gather
  and its backward's overlap; WGrad fused into the FP32 main_grad as runs have it) and its reduce-scatter;
* `jetrl` with `parallel.sp_overlap` none, chunks (2 and 4 pieces) and ring (`fp8.sequence_parallel.SPOverlap`), WGrad
  into the FP32 main_grad;
* `*-local`: each mode's GEMMs on the whole sequence with no communication (what the overlap can reach at best).

Before timing, each FP8 overlap is checked against `none` on every rank: gathered outputs, dX and dW equal to the bit,
reduce-scattered outputs within BF16 rounding of it (they sum in their collective's order). Times are medians over
`--reps` of one linear's forward + backward, CUDA events on rank 0's stream (all ranks run the same); printed per
linear with the ratio to `bf16`, and in total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench.common import QWEN3_8B, TINY, agreed_exit, median_ms, sync  # noqa: E402

OVERLAPS = ("none", "chunks2", "chunks4", "ring")


def linears(cfg: dict, tp: int) -> dict[str, tuple[str, int, int]]:
    """name -> (kind, output features, input features) of a TP rank: column-parallel outputs and row-parallel inputs
    divided by tp; down's input is [gate | up] (twice its K)."""
    h, ffn, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    for name, width in (("qkv", qkv), ("o", cfg["num_attention_heads"] * hd), ("ffn", ffn)):
        if width % tp:
            raise SystemExit(f"{name}'s width {width} does not split over {tp} ranks")
    return {
        "qkv": ("column", qkv // tp, h),
        "o": ("row", h, cfg["num_attention_heads"] * hd // tp),
        "gate_up": ("column", 2 * ffn // tp, h),
        "down": ("row-gated", h, ffn // tp),
    }


def overlap_of(name: str):
    from megatron_jetrl.fp8.sequence_parallel import SPOverlap

    return SPOverlap("chunks", int(name[6:])) if name.startswith("chunks") else SPOverlap(name)


def make_step(mode: str, overlap: str | None, kind: str, n: int, k: int, tokens: int, group, device, gen, gemm_sms: int = 0):
    """A closure running one forward + backward of this linear in this variant (overlap None: no communication), and
    the tensors it reads (for the check)."""
    from megatron.core.tensor_parallel import linear_with_grad_accumulation_and_async_allreduce
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import QuantizedWeight, fp8_linear

    world = dist.get_world_size(group)
    local = overlap is None
    column = kind == "column"
    rows = tokens if (local or not column) else tokens // world
    width = 2 * k if kind == "row-gated" else k
    x = (torch.randn(rows, width, generator=gen, device=device) * 2).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.05).to(torch.bfloat16).requires_grad_(True)
    w.main_grad = torch.zeros(n, k, dtype=torch.float32, device=device)
    out_rows = tokens if (local or column) else tokens // world
    dy = torch.randn(out_rows, n, generator=gen, device=device).to(torch.bfloat16)
    gated = F.silu if kind == "row-gated" else None

    if mode == "bf16":

        def forward():
            inp = x if gated is None else gated(x[:, :k]) * x[:, k:]
            fused = device.type == "cuda"  # (the CPU has no FP32-accumulating BF16 GEMM: w.grad there)
            y = linear_with_grad_accumulation_and_async_allreduce(inp, w, None, fused, False, column and not local)
            return y if (column or local) else reduce_scatter_to_sequence_parallel_region(y, group=group)

    else:
        flow = PrecisionFlow(mode="jetrl", backend="auto" if device.type == "cuda" else "emulated", gemm_sms=gemm_sms)
        qw = QuantizedWeight.quantize(w, flow, transposed=True)
        comm = {} if local else ({"sp_group": group} if column else {"rs_group": group})
        if not local:
            comm["sp_overlap"] = overlap_of(overlap)

        def forward():
            return fp8_linear(x, w, flow=flow, weight_q=qw, gated_act=gated, **comm)

    def step():
        x.grad = None
        y = forward()
        y.backward(dy)
        return y.detach(), x.grad

    return step, w


def check(results: dict, kind: str) -> dict:
    """Each overlap against `none`: what equal means for this kind (see the module's docstring)."""
    y0, dx0, dw0 = results["none"]
    out = {}
    for name, (y, dx, dw) in results.items():
        grads = torch.equal(dx, dx0) and torch.equal(dw, dw0)
        if kind == "column":
            ok, err = torch.equal(y, y0) and grads, 0.0
        else:
            err = ((y.float() - y0.float()).abs().max() / y0.float().abs().max().clamp_min(1e-30)).item()
            ok = grads and err <= 2.0**-6
        out[name] = {"ok": ok, "output_rel_err": err}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4352, help="tokens of the micro-batch, split over the ranks")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny stand-in, gloo, 256 tokens, 2 reps")
    p.add_argument("--gemm-sms", type=int, default=0, help="precision.gemm_sms of the FP8 linears (0: all SMs)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from megatron_jetrl.actor.parallel import init_parallel
    from megatron_jetrl.patching import load_patch

    cuda = torch.cuda.is_available() and not a.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    init_parallel(tp=world, backend="nccl" if cuda else "gloo")
    if cuda:
        load_patch("megatron_core_0_16_1_wgrad_fusion").apply()  # bf16's WGrad into main_grad, as runs fuse it
    from megatron.core import parallel_state as ps

    group, rank = ps.get_tensor_model_parallel_group(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg, tokens, reps = (TINY, 256, 2) if a.tiny else (QWEN3_8B, a.tokens, a.reps)
    if tokens % world:
        raise SystemExit(f"--tokens {tokens} does not split over {world} ranks")
    report = {
        "world": world,
        "tokens": tokens,
        "gemm_sms": a.gemm_sms,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "linears": {},
    }
    for name, (kind, n, k) in linears(cfg, world).items():
        row = {}
        checked = {}
        for mode in ("bf16", "jetrl"):
            variants = [(f"{mode}-local", None)] + ([("bf16", "none")] if mode == "bf16" else [(o, o) for o in OVERLAPS])
            for label, overlap in variants:
                gen = torch.Generator(device=device).manual_seed(1000 * rank + len(name))  # the same tensors per variant
                step, w = make_step(mode, overlap, kind, n, k, tokens, group, device, gen, a.gemm_sms)
                if mode == "jetrl" and overlap is not None:
                    y, dx = step()
                    checked[label] = (y, dx, w.main_grad.clone())
                row[label if mode == "bf16" or overlap is None else f"jetrl-{label}"] = median_ms(step, device, reps)
        row["check"] = check(checked, "column" if kind == "column" else "row")
        report["linears"][name] = row
        sync(device)
    if rank == 0:
        print_table(report)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    ok = all(c["ok"] for r in report["linears"].values() for c in r["check"].values())
    return agreed_exit(ok, device, "an overlap's result differs from none's (see check)")


def print_table(report: dict) -> None:
    labels = ["bf16", "bf16-local", *(f"jetrl-{o}" for o in OVERLAPS), "jetrl-local"]
    print(
        f"TP {report['world']} ({report['device']}), {report['tokens']} tokens, sequence parallel, FP8 GEMMs on "
        f"{report['gemm_sms'] or 'all'} SMs, CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, "
        "fwd+bwd ms (x bf16)"
    )
    print("| linear | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    total = dict.fromkeys(labels, 0.0)
    for name, row in report["linears"].items():
        cells = [f"{row[label]:.3f} ({row['bf16'] / row[label]:.2f}x)" for label in labels]
        for label in labels:
            total[label] += row[label]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| all four | " + " | ".join(f"{total[label]:.3f} ({total['bf16'] / total[label]:.2f}x)" for label in labels) + " |")
    for name, row in report["linears"].items():
        bad = {k: v for k, v in row["check"].items() if not v["ok"]}
        print(f"check {name}: " + ("every overlap as none" if not bad else f"DIFFERS {bad}"))


if __name__ == "__main__":
    raise SystemExit(main())
