#!/usr/bin/env python
"""What limits each phase of a GRPO step, FP8 against BF16: one table from the per-phase profiles that `run.profile_step`
writes (`profile_step<N>_rank<R>.json`, rl.profiling), one run per precision mode, same step and layout.

    python tools/profile_report.py RUN_DIR... [--rank 0] [-o PREFIX]

For each phase and run (rank `--rank`): wall time, the GPU's busy time and its share of the wall, idle time in gaps of
more than 20 us (the GPU waiting for the host), and kernel time for the linears' GEMMs (FP8 and BF16), the quantizers,
attention, communication and the rest. Then, against the bf16 run of the same phase:
- `wall`: the measured ratio (bf16 wall / mode wall; > 1: faster);
- `GPU work`: the ratio of the GPU's busy times, what the phase would gain if the GPU set its pace throughout;
- `host-bound`: the phase's verdict: `host` when the GPU sat idle for more than a quarter of the phase, `GPU` otherwise.
  A host-bound phase gains from fewer launches and less Python per step, not from faster kernels.

Runs with pipeline parallelism (PP > 1, every rank's profile present) get a second table: per phase, run and pipeline
stage (ranks averaged), the stage's own work (GPU busy time less pipeline send/recv: its compute and TP collectives), its
pipeline send/recv time (transfers and the wait for the neighbouring stage) and its idle time; per run, the bubble's
share of the phase -- 1 - mean stage work / wall, the time the stages leave unused -- beside the part of it that uneven
stages explain (`imbalance`: 1 - mean work / the busiest stage's work) and the 1F1B schedule's own (p - 1) / (m + p - 1)
for p stages and m micro-batches (from the run's config.yaml).

Prints the markdown tables and writes PREFIX.md (default: <first run dir>/profile_report). Exit 2 on bad arguments or a
run without a profile (named with the fix).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASELINE = "bf16"
HOST_BOUND_IDLE = 0.25
"""The idle share of a phase above which it is called host-bound."""
COLUMNS = (("GEMM FP8",), ("GEMM BF16",), ("quantize",), ("attention",), ("communication (NCCL)",))


def load(run: Path, rank: int) -> dict:
    """{"mode", "step", "phases"} of a run directory's profile at `rank`."""
    found = sorted(run.glob(f"profile_step*_rank{rank}.json"))
    if not found:
        raise ValueError(f"{run} has no profile_step*_rank{rank}.json: run it with run.profile_step=N (rl.profiling)")
    profile = json.loads(found[-1].read_text())
    mode = None
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("step") == profile["step"]:
                mode = row.get("mode")
    return {"run": run.name, "mode": mode or run.name, "step": profile["step"], "phases": profile["phases"]}


def load_ranks(run: Path, step: int) -> dict[int, dict]:
    """{rank: phases} of every rank's profile of `step` in a run directory."""
    out = {}
    for path in run.glob(f"profile_step{step}_rank*.json"):
        out[int(path.stem.rsplit("rank", 1)[1])] = json.loads(path.read_text())["phases"]
    return dict(sorted(out.items()))


def layout(run: Path, step: int) -> dict:
    """tp, pp, dp of a run (its metrics row at `step`; 1 where it says nothing) and, from its config.yaml when present,
    the micro-batches a rank runs per phase: update `grpo.micro_batch_size`, eval `grpo.logprob_micro_batch_size`."""
    row = {}
    if (run / "metrics.jsonl").exists():
        row = next((r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("step") == step), {})
    out = {k: int(row.get(k) or 1) for k in ("tp", "pp", "dp")}
    config = run / "config.yaml"
    if config.exists():
        import yaml

        cfg = yaml.safe_load(config.read_text())
        grpo, n = cfg["grpo"], cfg["grpo"]["prompts_per_step"] * cfg["rollout"]["n"] // out["dp"]
        out["microbatches"] = {
            "update": n // grpo["micro_batch_size"],
            "eval": n // (grpo.get("logprob_micro_batch_size") or grpo["micro_batch_size"]),
        }
    return out


P2P = "pipeline send/recv"
PIPELINED = ("eval", "update")
"""The phases that run through the pipeline schedule (the rollout runs in the engines, each holding the whole model)."""


def p2p_ms(phase: dict) -> float:
    """A phase's pipeline send/recv kernel time (profiles written before that category: its kernels among `top`)."""
    if P2P in phase["categories"]:
        return phase["categories"][P2P]
    return sum(ms for name, ms in phase.get("top", []) if "sendrecv" in name.lower())


def stage_rows(run: Path, mode: str, step: int) -> list[dict]:
    """Per phase and pipeline stage of a PP > 1 run (module docstring); [] for PP 1 or a run without every rank's profile."""
    shape, ranks = layout(run, step), load_ranks(run, step)
    pp, per_stage = shape["pp"], shape["tp"] * shape["dp"]
    if pp == 1 or len(ranks) < pp * per_stage:
        return []
    out = []
    for name in [ph for ph in PIPELINED if any(ph in phases for phases in ranks.values())]:
        stages = []
        for stage in range(pp):
            phases = [ranks[r][name] for r in range(stage * per_stage, (stage + 1) * per_stage) if name in ranks[r]]
            if not phases or any("busy_ms" not in p for p in phases):  # a stage without this phase, or a CPU profile
                break
            mean = lambda f: sum(map(f, phases)) / len(phases)  # noqa: E731
            stages.append(
                {
                    "phase": name,
                    "run": run.name,
                    "mode": mode,
                    "stage": stage,
                    "wall_ms": mean(lambda p: p["wall_ms"]),
                    "work_ms": mean(lambda p: max(0.0, p["busy_ms"] - p2p_ms(p))),
                    "p2p_ms": mean(p2p_ms),
                    "idle_ms": mean(lambda p: p["idle_ms"]),
                }
            )
        if len(stages) < pp:
            continue
        wall = max(st["wall_ms"] for st in stages)
        work = [st["work_ms"] for st in stages]
        m = shape.get("microbatches", {}).get(name)
        for st in stages:
            st.update(
                bubble=1 - sum(work) / len(work) / wall,
                imbalance=1 - sum(work) / len(work) / max(work),
                schedule=(pp - 1) / (m + pp - 1) if m else None,
                busiest=st["work_ms"] == max(work),
            )
        out.extend(stages)
    return out


STAGE_HEADER = [
    "phase",
    "mode",
    "stage",
    "wall ms",
    "work ms",
    "send/recv ms",
    "idle ms",
    "bubble share",
    "imbalance",
    "1F1B (p-1)/(m+p-1)",
]


def stage_table(rs: list[dict]) -> str:
    lines = ["| " + " | ".join(STAGE_HEADER) + " |", "|" + "---|" * len(STAGE_HEADER)]
    for r in rs:
        first = r["stage"] == 0  # the run's shares, once per phase
        share = (lambda v: "-" if v is None else f"{100 * v:.1f}%") if first else (lambda v: "")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["phase"],
                    r["mode"],
                    f"{r['stage']}{' (busiest)' if r['busiest'] else ''}",
                    f"{r['wall_ms']:.1f}",
                    f"{r['work_ms']:.1f}",
                    f"{r['p2p_ms']:.1f}",
                    f"{r['idle_ms']:.1f}",
                    share(r["bubble"]),
                    share(r["imbalance"]),
                    share(r["schedule"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


STAGE_CAPTION = (
    "Pipeline stages (ranks of a stage averaged). work: GPU busy time less pipeline send/recv (the stage's "
    "compute and TP collectives); send/recv: transfers plus the wait for the neighbouring stage; idle: no "
    "kernel running. bubble share: 1 - mean stage work / the phase's wall, the time the stages leave unused; "
    "imbalance: the part uneven stages explain (1 - mean work / the busiest stage's); 1F1B: the schedule's "
    "own bubble for p stages and m micro-batches a rank runs."
)


def long_idle(phase: dict) -> float:
    """Idle ms in gaps longer than 20 us (where the host, not a launch queue, held the GPU up)."""
    return sum(ms for label, ms in phase.get("idle_ms_by_gap_us", {}).items() if label in ("20-200", ">200"))


def rows(profiles: list[dict]) -> list[dict]:
    base = {p["mode"]: p for p in profiles}.get(BASELINE)
    out = []
    for name in dict.fromkeys(ph for p in profiles for ph in p["phases"]):
        for p in profiles:
            ph = p["phases"].get(name)
            if ph is None:
                continue
            cats = ph["categories"]
            row = {
                "phase": name,
                "run": p["run"],
                "mode": p["mode"],
                "wall_ms": ph["wall_ms"],
                "busy_ms": ph.get("busy_ms"),
                "idle_long_ms": long_idle(ph) if "busy_ms" in ph else None,
                **{col[0]: sum(cats.get(c, 0.0) for c in col) for col in COLUMNS},
                "other_ms": ph["kernel_ms"] - sum(cats.get(c, 0.0) for col in COLUMNS for c in col),
            }
            row["busy_share"] = row["busy_ms"] / ph["wall_ms"] if row["busy_ms"] is not None and ph["wall_ms"] else None
            row["bound"] = None if row["busy_share"] is None else ("host" if 1 - row["busy_share"] > HOST_BOUND_IDLE else "GPU")
            b = base["phases"].get(name) if base is not None else None
            row["wall_ratio"] = b["wall_ms"] / ph["wall_ms"] if b else None
            row["busy_ratio"] = b["busy_ms"] / ph["busy_ms"] if b and ph.get("busy_ms") and b.get("busy_ms") else None
            out.append(row)
    return out


HEADER = [
    "phase",
    "mode",
    "wall ms",
    "GPU busy ms (share)",
    "idle > 20 us ms",
    *(c[0] + " ms" for c in COLUMNS),
    "other ms",
    f"wall vs {BASELINE}",
    f"GPU work vs {BASELINE}",
    "bound",
]


def table(rs: list[dict]) -> str:
    def num(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rs:
        busy = "-" if r["busy_ms"] is None else f"{r['busy_ms']:.1f} ({100 * r['busy_share']:.0f}%)"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["phase"],
                    r["mode"],
                    num(r["wall_ms"]),
                    busy,
                    num(r["idle_long_ms"]),
                    *(num(r[c[0]]) for c in COLUMNS),
                    num(r["other_ms"]),
                    num(r["wall_ratio"], ".2f") + ("x" if r["wall_ratio"] else ""),
                    num(r["busy_ratio"], ".2f") + ("x" if r["busy_ratio"] else ""),
                    r["bound"] or "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


CAPTION = (
    f"One profiled step per run (run.profile_step), rank shown. GPU busy: the time some kernel ran (streams merged); "
    f"idle > 20 us: the GPU waiting in gaps longer than 20 us. Kernel ms per category (rl.profiling.CATEGORIES; "
    f"communication includes waiting for peers). wall vs {BASELINE}: {BASELINE} wall / mode wall (> 1: faster); GPU "
    f"work vs {BASELINE}: the same for the busy times, what the phase gains where the GPU sets the pace. bound: host "
    f"when the GPU idled for more than {100 * HOST_BOUND_IDLE:.0f}% of the phase, else GPU."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories holding profile_step<N>_rank<R>.json")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, help="PREFIX of the .md (default: <first run>/profile_report)")
    a = parser.parse_args(argv)
    try:
        profiles = [load(r, a.rank) for r in a.runs]
        staged = [r for run, p in zip(a.runs, profiles) for r in stage_rows(run, p["mode"], p["step"])]
    except (ValueError, OSError, json.JSONDecodeError, KeyError) as e:
        print(f"profile_report: {e}", file=sys.stderr)
        return 2
    text = table(rows(profiles)) + "\n\n" + CAPTION
    if staged:
        text += "\n\n" + stage_table(staged) + "\n\n" + STAGE_CAPTION
    prefix = a.output or a.runs[0] / "profile_report"
    try:
        Path(f"{prefix}.md").write_text(text + "\n")
    except OSError as e:
        print(f"profile_report: cannot write the report {prefix}.md: {e.strerror or e}", file=sys.stderr)
        return 2
    print(text + f"\n\nwrote {prefix}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
