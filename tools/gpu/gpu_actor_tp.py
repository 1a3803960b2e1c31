#!/usr/bin/env python3
"""TP1 vs TP2 of the megatron-core actor: logprobs and optimizer steps, on 2 GPUs (or 2 gloo CPU ranks).

    torchrun --nproc-per-node=2 tools/gpu/gpu_actor_tp.py [--json PATH]          # 2 GPUs, NCCL, BF16 params
    torchrun --nproc-per-node=2 tools/gpu/gpu_actor_tp.py --tiny                 # CPU dry run (gloo, FP32 params)

What it does, in one torchrun of 2 processes:

* rank 0 writes a random HF checkpoint (BF16 safetensors) of a Qwen3-style (QK-norm, untied lm_head) and a
  Qwen2-style (q/k/v bias, tied embeddings) model; default hidden 1024, 8 heads, 2 KV heads, head_dim 128,
  intermediate 3072, 4 layers, vocabulary 32011 (not a multiple of 256, so TP2 pads and masks vocab rows);
* layout TP1 (world 2 = DP2: both ranks run the same TP1 model) and then layout TP2 (one model over both
  ranks), through `actor.parallel.init_parallel`; each rank imports the checkpoint with
  `actor.hf_import.load_hf_weights` into `actor.provider.build_model(arch, flow, ActorOptions(params_dtype))`;
* per family and variant (`bf16`; `jetrl` on each FP8 GEMM backend the device has: emulated, cublaslt,
  triton), the same tokens (batch 4 x seq 512): `actor.logprobs.compute_logprobs`, then two optimizer steps
  of `actor.train_step.train_step` (megatron DDP + megatron optimizer, `OptimConfig(bf16=True)` on GPU) with a
  policy-gradient loss -(A * logprob).mean() (A = 1 .. 0.25: positive, so the loss is a weighted mean
  logprob and relative loss differences are meaningful), then logprobs again;
* calibration (`+bug` variants, bf16 and the first jetrl backend): at TP2 rank 1 zeroes its half of layer
  0's down_proj after the import, i.e. one lost row-parallel partial sum -- the size of a real sharding bug,
  against which a test bound must stay far below;
* rank 0 compares TP2 with TP1: logprobs max/mean |diff| and the fraction bit-equal, step-1 and step-2
  losses and grad norms (relative), logprobs after the two steps; also TP1 rank 0 vs rank 1 (two GPUs, the
  same program: determinism) and, for scale, the FP8 effect (jetrl vs bf16 at TP1) and backend effect
  (each fast backend vs emulated at TP1). A short table goes to stdout, everything to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FAMILIES = ("qwen3", "qwen2")


def hf_config(family: str, a) -> dict:
    cfg = dict(
        model_type=family,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=128,
        vocab_size=a.vocab,
        max_position_embeddings=max(a.seq, 64),
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
    )
    cfg["tie_word_embeddings"] = family == "qwen2"
    return cfg


def random_hf_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named BF16 weights: linears ~N(0, 0.02^2), embeddings ~N(0, 0.05^2), norms ~1 + N(0, 0.05^2)."""
    from megatron_jetrl.convert.synthetic import hf_state_for

    return hf_state_for(cfg, seed, std=0.02, embed_std=0.05, norm_std=0.05, bias_std=0.1, dtype=torch.bfloat16)


def write_checkpoints(root: Path, a) -> None:
    from safetensors.torch import save_file

    for k, family in enumerate(FAMILIES):
        cfg = hf_config(family, a)
        d = root / family
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(
            {n: t.contiguous() for n, t in random_hf_state(cfg, seed=a.seed * 1000 + 100 + k).items()},
            str(d / "model.safetensors"),
        )


def grpo_like_loss(logprobs, extras):
    loss = -(logprobs * extras["advantages"][:, None]).mean()
    return loss, {"mean_logprob": logprobs.detach().mean()}


BUG = "+bug"
"""Suffix of the calibration variants: at TP2, rank 1 zeroes its shard of layer 0's linear_fc2 (down_proj)
weight after the import -- what a lost row-parallel partial sum does to one layer. At TP1 such a variant
is its base variant (no bug), so TP2 vs TP1 shows how far a real sharding bug moves the numbers."""


def variants(device: torch.device, wanted: list[str], bugs: bool) -> tuple[list[tuple[str, dict]], list[str]]:
    """(name, PrecisionFlow kwargs) for bf16 and jetrl on each wanted backend this device has; and the skipped."""
    from megatron_jetrl.fp8.gemm import available_backends

    have = available_backends(device)
    out, skipped = [("bf16", dict(mode="bf16"))], []
    for b in wanted:
        if b in have:
            out.append((f"jetrl/{b}", dict(mode="jetrl", backend=b)))
        else:
            skipped.append(f"jetrl/{b} (not available on {device.type}; have {have})")
    if bugs:
        out += [(name + BUG, kw) for name, kw in out[:2]]
    return out, skipped


def inject_bug(model) -> None:
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.fp8_layers import unwrap

    if ps.get_tensor_model_parallel_world_size() > 1 and ps.get_tensor_model_parallel_rank() == 1:
        with torch.no_grad():
            dict(unwrap(model).named_parameters())["decoder.layers.0.mlp.linear_fc2.weight"].zero_()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_layout(tp: int, a, root: Path, device, tokens, advantages, var_list) -> dict:
    """Every family x variant at this TP: logprobs, 2 train steps, logprobs after. Values on CPU."""
    from megatron_jetrl.actor.fp8_layers import fp8_weights
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.logprobs import compute_logprobs
    from megatron_jetrl.actor.parallel import init_parallel
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    init_parallel(tp=tp, pp=1, seed=1234)
    dtype = torch.bfloat16 if a.params_dtype == "bf16" else torch.float32
    out = {}
    for family in FAMILIES:
        cfg = hf_config(family, a)
        arch = ModelArch.from_hf_config(cfg)
        for name, kw in var_list:
            if name.endswith(BUG) and tp == 1:
                continue  # the base variant's TP1 run is the reference
            flow = (
                PrecisionFlow(**kw, check_finite="sync" if a.check_finite else "off")
                if kw["mode"] != "bf16"
                else PrecisionFlow(**kw)
            )
            model = build_model(arch, flow, ActorOptions(params_dtype=dtype, max_sequence_length=max(a.seq, 64)))
            if device.type == "cuda":
                # build_model leaves the native spec's RMSNorm weights on the CPU (torch.ones without a device);
                # megatron's own get_model() moves every module with .cuda() -- so do we.
                model.cuda(device)
            load_hf_weights(model, arch, root / family)
            if name.endswith(BUG):
                inject_bug(model)
            sync(device)
            t0 = time.perf_counter()
            lp0 = compute_logprobs(model, tokens, vocab_size=arch.vocab_size, micro_batch_size=a.micro)
            sync(device)
            t_fwd = time.perf_counter() - t0
            ddp, opt = wrap_for_training(model, OptimConfig(lr=a.lr, clip_grad=1.0, bf16=dtype == torch.bfloat16))
            steps, t_steps = [], []
            for _ in range(a.steps):
                sync(device)
                t0 = time.perf_counter()
                steps.append(
                    train_step(
                        ddp,
                        opt,
                        tokens,
                        grpo_like_loss,
                        vocab_size=arch.vocab_size,
                        micro_batch_size=a.micro,
                        extras={"advantages": advantages},
                    )
                )
                sync(device)
                t_steps.append(time.perf_counter() - t0)
            lp1 = compute_logprobs(ddp, tokens, vocab_size=arch.vocab_size, micro_batch_size=a.micro)
            n_fp8 = len(fp8_weights(model))
            out[family, name] = {
                "lp0": lp0.cpu(),
                "lp1": lp1.cpu(),
                "steps": steps,
                "t_logprobs_s": t_fwd,
                "t_steps_s": t_steps,
                "n_fp8_linears": n_fp8,
            }
            if dist.get_rank() == 0:
                print(
                    f"[tp{tp}] {family:6s} {name:16s} logprobs {t_fwd:6.2f}s  steps {' '.join(f'{t:.2f}s' for t in t_steps)}  "
                    f"losses {[round(s.get('loss', float('nan')), 6) for s in steps]}  fp8 linears {n_fp8}",
                    flush=True,
                )
            del model, ddp, opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.double() - b.double()).abs()
    return {"max": float(d.max()), "mean": float(d.mean()), "bit_equal": float((a == b).float().mean())}


def rel(x, y) -> float:
    return abs(x - y) / max(abs(y), 1e-30)


def compare(tp1: dict, tp1_peer: dict, tp2: dict, tp2_peer: dict, var_names: list[str]) -> list[dict]:
    rows = []
    for family in FAMILIES:
        for name in var_names:
            base = name.removesuffix(BUG)
            r1, r2 = tp1[family, base], tp2[family, name]
            s1, s2 = r1["steps"], r2["steps"]
            row = {
                "family": family,
                "variant": name,
                "lp": diff(r2["lp0"], r1["lp0"]),
                "lp_after_steps": diff(r2["lp1"], r1["lp1"]),
                "loss_rel": [rel(b["loss"], c["loss"]) for b, c in zip(s2, s1)],
                "grad_norm_rel": [rel(b["grad_norm"], c["grad_norm"]) for b, c in zip(s2, s1)],
                "loss_tp1": [c["loss"] for c in s1],
                "loss_tp2": [b["loss"] for b in s2],
                "grad_norm_tp1": [c["grad_norm"] for c in s1],
                "grad_norm_tp2": [b["grad_norm"] for b in s2],
                "ok": all(s["ok"] for s in s1 + s2),
                "loss_abs": [abs(b["loss"] - c["loss"]) for b, c in zip(s2, s1)],
                "tp1_ranks_bit_equal": bool(
                    torch.equal(tp1_peer[family, base]["lp0"], r1["lp0"])
                    and torch.equal(tp1_peer[family, base]["lp1"], r1["lp1"])
                ),
                "tp2_ranks_bit_equal": bool(torch.equal(tp2_peer[family, name]["lp0"], r2["lp0"])),
                "lp_magnitude": float(r1["lp0"].abs().mean()),
                "fp8_vs_bf16_tp1": diff(r1["lp0"], tp1[family, "bf16"]["lp0"]) if base != "bf16" else None,
                "vs_emulated_tp1": (
                    diff(r1["lp0"], tp1[family, "jetrl/emulated"]["lp0"])
                    if base.startswith("jetrl/")
                    and base != "jetrl/emulated"
                    and not name.endswith(BUG)
                    and (family, "jetrl/emulated") in tp1
                    else None
                ),
                "t_logprobs_s": {"tp1": r1["t_logprobs_s"], "tp2": r2["t_logprobs_s"]},
                "t_steps_s": {"tp1": r1["t_steps_s"], "tp2": r2["t_steps_s"]},
                "n_fp8_linears": {"tp1": r1["n_fp8_linears"], "tp2": r2["n_fp8_linears"]},
            }
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\nTP2 vs TP1 (same weights, same tokens); losses/grad norms relative, logprobs absolute")
    hdr = (
        "family",
        "variant",
        "lp max|d|",
        "lp mean|d|",
        "lp bit-eq",
        "loss1 rel",
        "gnorm1 rel",
        "loss2 rel",
        "gnorm2 rel",
        "lp@2 max|d|",
        "ranks eq",
        "FP8 vs bf16 max|d|",
    )
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        lr, gr = r["loss_rel"] + [float("nan")] * 2, r["grad_norm_rel"] + [float("nan")] * 2
        f8 = r["fp8_vs_bf16_tp1"]
        cells = [
            r["family"],
            r["variant"],
            f"{r['lp']['max']:.3g}",
            f"{r['lp']['mean']:.3g}",
            f"{r['lp']['bit_equal']:.3f}",
            f"{lr[0]:.2g}",
            f"{gr[0]:.2g}",
            f"{lr[1]:.2g}",
            f"{gr[1]:.2g}",
            f"{r['lp_after_steps']['max']:.3g}",
            f"{'y' if r['tp1_ranks_bit_equal'] else 'N'}/{'y' if r['tp2_ranks_bit_equal'] else 'N'}",
            "-" if f8 is None else f"{f8['max']:.3g}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        "\nlosses (step 1, step 2) TP1 -> TP2: "
        + "; ".join(
            f"{r['family']} {r['variant']}: " + ", ".join(f"{x:.5f}->{y:.5f}" for x, y in zip(r["loss_tp1"], r["loss_tp2"]))
            for r in rows
        )
    )
    extra = [r for r in rows if r["vs_emulated_tp1"]]
    if extra:
        print(
            "\nbackend vs emulated at TP1 (logprobs): "
            + "; ".join(
                f"{r['family']} {r['variant']}: max {r['vs_emulated_tp1']['max']:.3g}, mean {r['vs_emulated_tp1']['mean']:.3g}"
                for r in extra
            )
        )
    print(
        "mean |logprob|: " + ", ".join(sorted({f"{r['family']} {r['lp_magnitude']:.2f}" for r in rows if r["variant"] == "bf16"}))
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32011)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    p.add_argument("--backends", nargs="*", default=["emulated", "cublaslt", "triton"])
    p.add_argument("--params-dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--no-bugs", action="store_true", help="skip the injected-bug calibration variants")
    p.add_argument("--check-finite", action="store_true", help="PrecisionFlow.check_finite (a host sync per quantization)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run shapes (hidden 256, 2 layers, vocab 300, seq 32)")
    p.add_argument("--workdir", default=None, help="checkpoint folder (default: a temp dir)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.tiny:
        a.hidden, a.ffn, a.heads, a.kv_heads, a.layers, a.vocab, a.seq = 256, 512, 4, 2, 2, 301, 32
    cuda = torch.cuda.is_available()
    a.params_dtype = a.params_dtype or ("bf16" if cuda else "fp32")
    if not cuda:
        torch.set_num_threads(1)

    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel

    init_parallel(tp=1, pp=1)  # brings up the process group (world 2: DP2)
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node=2")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    root = Path(a.workdir or os.path.join(tempfile.gettempdir(), f"gpu_actor_tp_{os.environ.get('MASTER_PORT', '0')}_{a.seed}"))
    if rank == 0:
        t0 = time.perf_counter()
        write_checkpoints(root, a)
        print(
            f"checkpoints in {root} ({time.perf_counter() - t0:.1f}s); device {device}"
            + (f" {torch.cuda.get_device_name(device)}" if cuda else "")
            + f", torch {torch.__version__}",
            flush=True,
        )
    dist.barrier()
    g = torch.Generator().manual_seed(a.seed * 1000 + 7)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    # positive advantages: the loss is a weighted mean logprob (~ -6), so relative loss differences mean
    # something (zero-mean GRPO advantages make the loss a small difference of large terms)
    advantages = torch.linspace(1.0, 0.25, a.batch).to(device)
    var_list, skipped = variants(device, a.backends, not a.no_bugs)
    if rank == 0 and skipped:
        print("skipped: " + "; ".join(skipped), flush=True)

    results = {}
    for tp in (1, 2):
        results[tp] = run_layout(tp, a, root, device, tokens, advantages, var_list)
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    destroy_parallel()
    if rank != 0:
        return
    mine, peer = gathered[0], gathered[1]
    rows = compare(mine[1], peer[1], mine[2], peer[2], [n for n, _ in var_list])
    print_table(rows)
    if a.json:
        meta = {k: v for k, v in vars(a).items()}
        meta.update(
            torch=torch.__version__,
            device=torch.cuda.get_device_name(device) if cuda else "cpu",
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
