#!/usr/bin/env python3
"""What the rank-order TP sum of exact logprobs costs against NCCL's all-reduce, per call, at the sizes it runs.

    torchrun --nproc-per-node=4 tools/bench/bench_ordered_reduce.py [--rows 32 256 1088 4352 8320] [--graphs] [--json PATH]
    torchrun --nproc-per-node=2 tools/bench/bench_ordered_reduce.py --tiny          # CPU smoke run (gloo)

One group of all ranks; each rank holds a random BF16 `[rows, --hidden]` partial output (Qwen3-8B's row-parallel
linears: hidden 4096; a decode step's rows, a micro-batch's tokens). Variants (`models.ordered_reduce`):

* `nccl`: NCCL's all-reduce in place, megatron's and vLLM's sum without exact logprobs (its own order);
* `gather-torch`: all-gather the partials, then torch's casts and adds in rank order (the formula on the CPU);
* `gather`: all-gather, then the one-kernel `ordered_sum` (vLLM's patched all-reduce above TP 2);
* `ordered`: `ordered_all_reduce`, an all-to-all of each rank's share, its sum, an all-gather (the actor's).

Before timing, the three rank-order variants are checked on every rank: the same bytes as each other and as rank 0's
(`nccl` is reported by how many of its elements differ from them, and by its largest difference against the largest
sum). Times are medians over `--reps` calls, CUDA events on each rank's stream, printed in us with the ratio to
`nccl`: eager calls, or with `--graphs` each variant captured once in a CUDA graph and replayed (as vLLM replays its
decode steps, and the actor's layers under `model.cuda_graphs`: the host's share at small sizes gone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench.common import agreed_exit, graphed, median_ms  # noqa: E402

VARIANTS = ("nccl", "gather-torch", "gather", "ordered")


def torch_sum(parts: torch.Tensor) -> torch.Tensor:
    """The rank-order sum as torch ops, kernel by kernel (`ordered_sum`'s CPU formula, run on any device)."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts.dtype)


def steps(x: torch.Tensor, group) -> dict:
    """Variant -> a closure returning the sum of `x` over `group` (`nccl`'s timed call sums a zero buffer in place:
    the same bytes on the wire, and values that never grow)."""
    from megatron_jetrl.models.ordered_reduce import ordered_all_reduce, ordered_sum

    world = dist.get_world_size(group)
    parts = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    zeros = torch.zeros_like(x)

    def gathered():
        dist.all_gather_into_tensor(parts.view(-1, *x.shape[1:]), x, group=group)
        return parts

    def nccl():
        dist.all_reduce(zeros, group=group)
        return zeros

    return {
        "nccl": nccl,
        "gather-torch": lambda: torch_sum(gathered()),
        "gather": lambda: ordered_sum(gathered()),
        "ordered": lambda: ordered_all_reduce(x, group),
    }


def check(x: torch.Tensor, run: dict, group) -> dict:
    """The rank-order variants' bytes against each other and rank 0's; NCCL's sum against them."""
    sums = {v: run[v]().clone() for v in VARIANTS[1:]}
    first = sums["ordered"]
    rank0 = first.clone()
    dist.broadcast(rank0, group_src=0, group=group)
    nccl = x.clone()
    dist.all_reduce(nccl, group=group)
    return {
        "same": all(torch.equal(s, first) for s in sums.values()),
        "as_rank0": torch.equal(first, rank0),
        "nccl_differ": float((nccl != first).float().mean()),
        "nccl_max_rel": float((nccl.float() - first.float()).abs().max() / first.float().abs().max().clamp_min(1e-30)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1088, 4352, 8320], help="tokens per call")
    p.add_argument("--hidden", type=int, default=4096, help="the row-parallel linears' output width (Qwen3-8B: 4096)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--graphs",
        action="store_true",
        help="time each variant as a CUDA graph's replay (vLLM replays its decode steps so: no host time in the call)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: gloo, rows 3 and 41 of width 97 (uneven shares), 2 reps")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if "WORLD_SIZE" not in os.environ:
        p.error("run it under torchrun: torchrun --nproc-per-node=N tools/bench/bench_ordered_reduce.py")
    if min(a.rows) < 1 or a.hidden < 1 or a.reps < 1:
        p.error(f"--rows, --hidden and --reps must be >= 1, got {a.rows}, {a.hidden}, {a.reps}")
    cuda = torch.cuda.is_available() and not a.tiny
    if a.graphs and not cuda:
        p.error("--graphs captures CUDA graphs: it needs a GPU (and no --tiny)")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows, hidden, reps = ([3, 41], 97, 2) if a.tiny else (a.rows, a.hidden, a.reps)
    report = {
        "world": world,
        "hidden": hidden,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "graphs": a.graphs,
        "rows": {},
    }
    for m in rows:
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        x = (torch.randn(m, hidden, generator=g, device=device) * 4).to(torch.bfloat16)
        run = steps(x, group)
        row = {"check": check(x, run, group), "mb": x.numel() * x.element_size() / 1e6}
        for variant in VARIANTS:
            row[variant] = 1e3 * median_ms(graphed(run[variant]) if a.graphs else run[variant], device, reps)
        report["rows"][m] = row
    ok = all(r["check"]["same"] and r["check"]["as_rank0"] for r in report["rows"].values())
    if rank == 0:
        print_table(report)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    return agreed_exit(ok, device, "the rank-order sums differ (see check)")


def print_table(report: dict) -> None:
    how = "CUDA graph replays" if report["graphs"] else "eager calls"
    print(
        f"TP sum over {report['world']} ranks ({report['device']}), BF16 rows of {report['hidden']}, us per call (x nccl), {how}"
    )
    print("| rows | MB | " + " | ".join(VARIANTS) + " | rank-order bytes | nccl vs them |")
    print("|---" * (len(VARIANTS) + 4) + "|")
    for m, row in report["rows"].items():
        cells = [f"{row[v]:.1f} ({row['nccl'] / row[v]:.2f}x)" for v in VARIANTS]
        c = row["check"]
        same = "same on every rank" if c["same"] and c["as_rank0"] else "DIFFER"
        print(
            f"| {m} | {row['mb']:.2f} | " + " | ".join(cells) + f" | {same} | "
            f"{100 * c['nccl_differ']:.1f}% differ, max {c['nccl_max_rel']:.1e} of the largest sum |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
