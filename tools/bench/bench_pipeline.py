#!/usr/bin/env python3
"""The pipelined update: one GRPO training step of a Qwen3-8B-shaped actor split into pipeline stages, FP8 (`jetrl`)
against BF16, and where each stage's GPU time goes.

    torchrun --nproc-per-node=2 tools/bench/bench_pipeline.py --layers 18 --pp-last-layers 8 --seq 1088 \\
        --micro-batch 4 --micro-batches 32 --override precision.exact_logprobs=false [--json PATH]
    torchrun --nproc-per-node=2 tools/bench/bench_pipeline.py --tp 2 --layers 8 --override parallel.sequence_parallel=true
    torchrun --nproc-per-node=2 tools/bench/bench_pipeline.py --tiny          # CPU smoke run (gloo, emulated FP8)

TP `--tp` (1) x PP = the world size / tp: the pipeline's stages, each over a TP group (the table's rows: every
rank, by its global rank; TP ranks of a stage follow each other). Each variant is what `bench_actor.py` times on one GPU (`StepRun`: the
launcher's config for the mode, `build_model` of this rank's stage, megatron DDP and optimizer, `train_step` with
the GRPO loss and megatron's 1F1B schedule), so the two tools' numbers compare: the same layers on one GPU against
the same layers in a pipeline. Every variant gets the BF16 variant's initial weights; before timing, the last
stage's logprobs must be within a centered relative error of 0.5 of BF16's (FP8 noise ~0.05-0.2) and the first
step finite and taken.

Timing: wall clock of `train_step` with every stage synchronized before and after (device sync and a barrier),
median over `--steps` after `--warmup`; and the forward-only logprob pass over the same rows.

`--profile` adds one profiled step per variant (torch.profiler on every stage at once), read per stage as a run's
`run.profile_step` reads a phase (`megatron_jetrl.rl.profiling`): wall, busy (some kernel ran) and idle (the GPU waited
for its host), the pipeline's send/recv kernels (the transfers and the wait for the neighbouring stage), launches and
kernel time by category. With M micro-batches and P stages, 1F1B takes about (M + P - 1) x the busiest stage's compute
per micro-batch; the table prints that bound beside the measured step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench import bench_actor as ba  # noqa: E402
from tools.bench.common import TINY  # noqa: E402


def _sync_all(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def profiled_stage(fn, device) -> dict:
    """One `fn()` under torch.profiler on this rank, summarized as a run's profiled phase is (`rl.profiling`)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_jetrl.rl import profiling

    if device.type != "cuda":  # the CPU smoke run has no kernel timeline
        fn()
        return {}
    _sync_all(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync_all(device)
        wall = time.perf_counter() - t0
    return profiling.summarize(profiling._events(prof), wall, cuda=True)


def run_variant(a, label, cfg, arch, state, bf16_lp, device) -> tuple[dict, dict | None, object]:
    """One variant: checks, timed steps, the logprob pass, the profile. Returns (row, its CPU state, its last-stage
    logprobs) -- the state and logprobs are what later variants are checked against when this is the baseline."""
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.logprobs import response_start
    from megatron_jetrl.actor.parallel import from_last_stage

    last = ps.is_pipeline_last_stage()
    batch = a.micro_batch * a.micro_batches
    tokens, mask, adv = ba.make_batch(arch.vocab_size, batch, a.seq, device)
    run = ba.StepRun(label, cfg, arch, arch.num_layers, device, state=state)
    try:
        with torch.no_grad():
            lp = run.logprobs(tokens, a.micro_batch)
        err = None
        if last:
            lp = lp.float()
            if bf16_lp is not None:
                c, cr = lp - lp.mean(-1, keepdim=True), bf16_lp - bf16_lp.mean(-1, keepdim=True)
                err = float((c - cr).norm() / cr.norm().clamp_min(1e-30))
            elif not bool(torch.isfinite(lp).all()):
                err = float("nan")
        err = from_last_stage(err)
        if err is not None and not (math.isfinite(err) and err < 0.5):
            raise RuntimeError(f"{label}: logprobs differ from BF16 on the same weights: centered relative error {err:.3g}")
        old = (bf16_lp if bf16_lp is not None else lp) if last else torch.zeros(batch, a.seq - 1, device=device)
        extras = {"old": old, "adv": adv, "mask": mask, "rollout": old, "ref": old, "first": response_start(mask)}
        times, first = [], None
        if device.type == "cuda":  # this variant's own peak
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(a.warmup + a.steps):
            _sync_all(device)
            t0 = time.perf_counter()
            out = run.step(tokens, extras, a.micro_batch)
            _sync_all(device)
            if i == 0:
                first = from_last_stage(out)
                if not (first.get("ok") and math.isfinite(first.get("loss", float("nan")))):
                    raise RuntimeError(f"{label}: first step not taken or not finite: {first}")
            if i >= a.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        lp_times = []
        with torch.no_grad():
            for _ in range(a.steps):
                _sync_all(device)
                t0 = time.perf_counter()
                run.logprobs(tokens, a.logprob_micro_batch or a.micro_batch)
                _sync_all(device)
                lp_times.append((time.perf_counter() - t0) * 1e3)
        stage = profiled_stage(lambda: run.step(tokens, extras, a.micro_batch), device) if a.profile else {}
        if a.host_profile:  # every rank prints its own, one after the other
            for rank in range(dist.get_world_size()):
                _sync_all(device)
                if rank == dist.get_rank():
                    stage["host_profile"] = ba.host_profile(
                        lambda: run.step(tokens, extras, a.micro_batch), a.host_profile, f"{label} rank {rank}"
                    )
                else:  # the other ranks run the same step (the pipeline needs them), unprofiled
                    run.step(tokens, extras, a.micro_batch)
        stages = [None] * dist.get_world_size()
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        dist.all_gather_object(stages, dict(stage, peak_gib=peak))
        row = {
            "variant": label,
            "step_ms": sorted(times)[len(times) // 2],
            "step_ms_all": times,
            "logprob_ms": sorted(lp_times)[len(lp_times) // 2],
            "lp_rel_err_vs_bf16": err or 0.0,
            "first_loss": first.get("loss"),
            "first_grad_norm": first.get("grad_norm"),
            "stages": stages,
        }
        return row, (run.cpu_state() if state is None else None), (lp if last else None)
    finally:
        run.close()


def report(rows, a, pp: int, tp: int = 1) -> None:
    base = rows[0]
    print(f"\n{a.layers} layers, TP {tp} x PP {pp}, {a.micro_batches} micro-batches of {a.micro_batch} x {a.seq} tokens a step")
    print("| variant | step ms | vs bf16 | logprob pass ms | vs bf16 | lp rel. err | first loss | grad norm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['step_ms']:.1f} | {base['step_ms'] / r['step_ms']:.2f}x | {r['logprob_ms']:.1f} | "
            f"{base['logprob_ms'] / r['logprob_ms']:.2f}x | {r['lp_rel_err_vs_bf16']:.3g} | {r['first_loss']:.4g} | "
            f"{r['first_grad_norm']:.4g} |"
        )
    if not rows[0]["stages"][0].get("busy_ms"):
        return
    print(
        "\nProfiled step, per stage (ms; `rl.profiling`'s reading: busy = some kernel ran, send/recv = the pipeline's "
        "NCCL kernels, the wait for the neighbouring stage included; compute / mb = (busy - send/recv) / micro-batches; "
        "1F1B bound = (M + P - 1) x the busiest stage's compute / mb):"
    )
    cats = ["GEMM FP8", "GEMM BF16", "quantize", "attention", "optimizer"]
    print("| variant | rank | wall | busy | idle | send/recv | launches | compute / mb | " + " | ".join(cats) + " | peak GiB |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(cats) + "---|")
    for r in rows:
        for i, s in enumerate(r["stages"]):
            p2p = s["categories"].get("pipeline send/recv", 0.0)
            s["compute_per_mb_ms"] = (s["busy_ms"] - p2p) / a.micro_batches
            print(
                f"| {r['variant']} | {i} | {s['wall_ms']:.1f} | {s['busy_ms']:.1f} | {s['idle_ms']:.1f} | {p2p:.1f} | "
                f"{s['launches']} | {s['compute_per_mb_ms']:.2f} | "
                + " | ".join(f"{s['categories'].get(c, 0.0):.1f}" for c in cats)
                + f" | {s['peak_gib']:.1f} |"
            )
        busiest = max(s["compute_per_mb_ms"] for s in r["stages"])
        r["bound_1f1b_ms"] = (a.micro_batches + pp - 1) * busiest
        print(f"| {r['variant']} | 1F1B bound | {r['bound_1f1b_ms']:.1f} | | | | | {busiest:.2f} |" + " |" * len(cats) + " |")
    for r in rows[1:]:
        per = [b["compute_per_mb_ms"] / s["compute_per_mb_ms"] for b, s in zip(base["stages"], r["stages"])]
        print(
            f"{r['variant']} vs bf16: step {base['step_ms'] / r['step_ms']:.2f}x, stage compute "
            + ", ".join(f"{x:.2f}x" for x in per)
            + f", 1F1B bound {base['bound_1f1b_ms'] / r['bound_1f1b_ms']:.2f}x"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["bf16", "jetrl"], help="MODE[+section.key=value...], as bench_actor")
    p.add_argument("--preset", default=ba.DEFAULT_PRESET)
    p.add_argument(
        "--override", nargs="*", action="extend", default=[], help="section.key=value overrides for every variant (repeatable)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size; the pipeline's is the world size / tp")
    p.add_argument("--layers", type=int, default=18, help="decoder layers of the whole model")
    p.add_argument(
        "--pp-last-layers",
        type=lambda v: v if v == "auto" else int(v),
        default=0,
        help="layers of the last stage (parallel.pp_last_layers: a count, 0 even, or auto)",
    )
    p.add_argument("--seq", type=int, default=1088)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--logprob-micro-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="one more step per variant under torch.profiler, per stage")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="one more step per variant and rank under cProfile: its N costliest functions by self time (a blocking "
        "call shows as its wait)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: hidden 256, 4 layers, a few tokens")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    for name in ("tp", "layers", "seq", "micro_batch", "micro_batches", "steps", "warmup"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if "WORLD_SIZE" not in os.environ:
        p.error("run it under torchrun, one process per pipeline stage: torchrun --nproc-per-node=2 " + sys.argv[0])
    if not torch.cuda.is_available() and not a.tiny:
        print("error: bench_pipeline.py needs CUDA GPUs (one a stage), or --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    variants = ba.parse_modes(a.modes)
    if a.tiny:
        a.layers, a.seq, a.micro_batch, a.micro_batches, a.steps, a.warmup = 4, 64, 2, 4, 1, 1
        a.override = ["precision.exact_logprobs=false", *a.override]
    world = int(os.environ["WORLD_SIZE"])
    if world % a.tp:
        p.error(f"--tp {a.tp} does not divide the {world} ranks torchrun started")
    pp = world // a.tp
    over = [
        f"parallel.tp={a.tp}",
        f"rollout.tp={a.tp}",
        f"parallel.pp={pp}",
        f"parallel.pp_last_layers={a.pp_last_layers}",
        f"model.hf_config.num_hidden_layers={a.layers}",
        *a.override,
    ]
    cfgs = {label: ba.load_preset(mode, a.preset, [*ov, *over]) for label, mode, ov in variants}
    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel
    from megatron_jetrl.models.arch import ModelArch

    init_parallel(tp=a.tp, pp=pp)
    import dataclasses

    arch = ModelArch.from_hf_config(dict(TINY, num_hidden_layers=a.layers)) if a.tiny else cfgs[variants[0][0]].arch()
    arch = dataclasses.replace(arch, num_layers=a.layers, max_position_embeddings=max(a.seq, arch.max_position_embeddings))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rank0 = dist.get_rank() == 0
    if rank0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(
            f"{world} x {name}, torch {torch.__version__}; TP {a.tp} x PP {pp}, {a.layers} Qwen3-8B-shaped layers, "
            f"last stage {a.pp_last_layers or 'even'}"
        )
    rows, state, bf16_lp = [], None, None
    for label, _, _ in variants:
        row, st, lp = run_variant(a, label, cfgs[label], arch, state, bf16_lp, device)
        if state is None:
            state, bf16_lp = st, lp
        rows.append(row)
        if rank0:
            print(f"  {label:28s} step {row['step_ms']:9.1f} ms  logprob pass {row['logprob_ms']:8.1f} ms", flush=True)
        ba._gc()
    destroy_parallel()
    if rank0:
        report(rows, a, pp, a.tp)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "world": world, "tp": a.tp, "pp": pp, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
