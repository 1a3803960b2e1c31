#!/usr/bin/env python
"""Train/rollout mismatch against response length (one curve per run), and reward against step, into one PNG.

    .venv/bin/python tools/plot_length_mismatch.py LABEL=RUN ... [--floor LABEL=RUN ...] -o out.png [--table out.md]

RUN is a run directory or its metrics.jsonl. The trainer logs, per step and per response-length bucket
[2^k, 2^(k+1)) tokens, `mismatch/len<lo>-<hi>/<stat>` with stat in tokens, responses, mean_abs_diff, k3_kl,
max_abs_diff, abs_diff_gt1_frac, seq_abs_log_ratio (rollout/metrics.py). Over all steps of a run, a bucket's
mean |logp diff|, k3 KL and share of tokens with |logp diff| > 1 are token-weighted means of the steps' values,
its sequence |log ratio| the response-weighted mean, its max the max; each is drawn at the bucket's mean
response length (its tokens / its responses), on a log2 length axis. A floor run (e.g. bf16: the BF16 floor;
jetrl with a second FP8 program: the FP8 floor) is drawn dashed, per bucket like the runs when it has length
buckets (the floor at each length), else as a horizontal line at its token-weighted mean over every step
(`mismatch/*`, all lengths; max: the max; none in the sequence panel, a per-bucket statistic). The last
panel is the reward (mean) per step of every run, floors dashed (the BF16 run is the accuracy to keep).
`--table` also writes the per-bucket numbers as a markdown table (one row per bucket, columns per run), and, for runs
that log them (`mismatch/p<lo>-<hi>/*`, rollout/metrics.py `by_confidence`), a second table by the trainer's probability
of the sampled token: token-weighted mean |logp diff| and k3 KL, and the share of tokens, per confidence bucket.
`--min-responses N` (default 8) leaves out of the curves the buckets with fewer than N responses over all steps
(a 3-response bucket's mean says little and sets the axis); the tool names each one it leaves out, and the table
keeps every bucket.

Exit status: 0 written; 2 a run unreadable, without rows, or without length buckets (one line says which).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_jetrl.rl.metrics import read_metrics  # noqa: E402

PANELS = (
    ("mean_abs_diff", "mean |logp train - rollout|"),
    ("k3_kl", "k3 KL"),
    ("max_abs_diff", "max |logp diff|"),
    ("abs_diff_gt1_frac", "share of tokens with |logp diff| > 1"),
    ("seq_abs_log_ratio", "sequence |log pi_train/pi_rollout|"),
)
TOKEN_MEANS = ("mean_abs_diff", "k3_kl", "abs_diff_gt1_frac")
FLOOR_COLORS = ("gray", "black", "brown")
TABLE_STATS = (
    ("mean_abs_diff", "mean \\|dlogp\\|", ".4f"),
    ("k3_kl", "k3 KL", ".2e"),
    ("abs_diff_gt1_frac", "share \\|dlogp\\|>1", ".1e"),
    ("seq_abs_log_ratio", "seq \\|log ratio\\|", ".3f"),
)
BUCKET = re.compile(r"^mismatch/len(\d+)-(\d+)/tokens$")
CONFIDENCE = re.compile(r"^mismatch/p([0-9.]+)-([0-9.]+)/tokens$")


def read_run(spec: str) -> tuple[str, list[dict]]:
    """`LABEL=RUN` -> (label, metrics rows); ValueError naming the problem."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"{spec!r}: write LABEL=RUN (a run directory or its metrics.jsonl)")
    p = Path(path)
    if not (p.is_file() or (p / "metrics.jsonl").is_file()):
        raise ValueError(f"{path}: no metrics.jsonl there (give a GRPO run directory or its metrics.jsonl)")
    try:
        rows = read_metrics(p)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no readable metrics rows")
    return label, rows


def pooled(
    rows: list[dict],
    pattern: re.Pattern,
    token_means: tuple[str, ...],
    response_means: tuple[str, ...] = (),
    maxes: tuple[str, ...] = (),
) -> dict[tuple[str, ...], dict[str, float]]:
    """{bucket's edges as matched: {stat: value over all steps}} for the buckets whose `<tag>/tokens` keys match
    `pattern`: token-weighted means of `token_means`, response-weighted means of `response_means`, max of `maxes`."""
    stats = ("tokens", *(("responses",) if response_means else ()), *token_means, *response_means, *maxes)
    out: dict[tuple[str, ...], dict[str, float]] = {}
    for r in rows:
        for key in r:
            m = pattern.match(key)
            if not m or not r[key]:
                continue
            tag = key.removesuffix("/tokens")
            values = {stat: r.get(f"{tag}/{stat}") for stat in stats}
            if None in values.values():
                raise ValueError(f"step {r['step']}: bucket {tag} lacks a value or holds a non-finite one ({values})")
            acc = out.setdefault(m.groups(), dict.fromkeys(stats, 0.0))
            for stat in ("tokens", "responses")[: 1 + bool(response_means)]:
                acc[stat] += values[stat]
            for stat in token_means:
                acc[stat] += values["tokens"] * values[stat]
            for stat in response_means:
                acc[stat] += values["responses"] * values[stat]
            for stat in maxes:
                acc[stat] = max(acc[stat], values[stat])
    for acc in out.values():
        for stat in token_means:
            acc[stat] /= acc["tokens"]
        for stat in response_means:
            acc[stat] /= acc["responses"]
    return out


def by_length(rows: list[dict]) -> dict[tuple[int, int], dict[str, float]]:
    """{(lo, hi): {stat: value over all steps}} (module docstring)."""
    out = pooled(rows, BUCKET, TOKEN_MEANS, ("seq_abs_log_ratio",), ("max_abs_diff",))
    return dict(sorted(((int(lo), int(hi)), v) for (lo, hi), v in out.items()))


def floor_level(rows: list[dict], stat: str) -> float:
    """A floor run's value of `stat` over all its steps: token-weighted mean (max for max_abs_diff)."""
    pairs = [(r.get("mismatch/tokens") or 0, r.get(f"mismatch/{stat}")) for r in rows]
    pairs = [(n, v) for n, v in pairs if n and v is not None]
    if not pairs:
        return math.nan
    if stat == "max_abs_diff":
        return max(v for _, v in pairs)
    return sum(n * v for n, v in pairs) / sum(n for n, _ in pairs)


def table(runs: list[tuple[str, list[dict]]]) -> str:
    """The per-bucket statistics of every run (floors included) as one markdown table, a row per length bucket."""
    per_run = [(label, by_length(rows)) for label, rows in runs]
    keys = sorted({k for _, b in per_run for k in b})
    head = ["length bucket", *(f"{label}: responses" for label, _ in per_run)]
    head += [f"{label}: {name}" for _, name, _ in TABLE_STATS for label, _ in per_run]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lo, hi in keys:
        cells = [f"{lo}-{hi}"] + [str(int(b[(lo, hi)]["responses"])) if (lo, hi) in b else "-" for _, b in per_run]
        for stat, _, fmt in TABLE_STATS:
            cells += [format(b[(lo, hi)][stat], fmt) if (lo, hi) in b else "-" for _, b in per_run]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sparse_buckets(runs: list[tuple[str, list[dict]]], min_responses: int) -> list[str]:
    """'label lenLO-HI (N responses)' for every bucket that the curves leave out (fewer than min_responses)."""
    return [
        f"{label} len{lo}-{hi} ({int(b['responses'])} responses)"
        for label, rows in runs
        for (lo, hi), b in by_length(rows).items()
        if b["responses"] < min_responses
    ]


def by_confidence(rows: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """{(lo, hi): {tokens, mean_abs_diff, k3_kl}} over all steps, token-weighted; {} for a run without the buckets."""
    return dict(sorted(pooled(rows, CONFIDENCE, ("mean_abs_diff", "k3_kl")).items(), key=lambda kv: float(kv[0][0])))


def confidence_table(runs: list[tuple[str, list[dict]]]) -> str:
    """The confidence buckets of the runs that have them, as one markdown table ('' when none has)."""
    per_run = [(label, by_confidence(rows)) for label, rows in runs]
    per_run = [(label, b) for label, b in per_run if b]
    if not per_run:
        return ""
    keys = sorted({k for _, b in per_run for k in b}, key=lambda k: float(k[0]))
    total = {label: sum(x["tokens"] for x in b.values()) for label, b in per_run}
    head = [
        "p(sampled token), trainer",
        *(f"{label}: {name}" for name in ("share of tokens", "mean \\|dlogp\\|", "k3 KL") for label, _ in per_run),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = [f"{key[0]}-{key[1]}"]
        for stat, fmt in (("share", ".3f"), ("mean_abs_diff", ".4f"), ("k3_kl", ".2e")):
            for label, b in per_run:
                if key not in b:
                    cells.append("-")
                else:
                    v = b[key]["tokens"] / total[label] if stat == "share" else b[key][stat]
                    cells.append(format(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curve(rows: list[dict], stat: str, min_responses: int = 1) -> tuple[list[float], list[float]]:
    """(mean response length, value of `stat`) per length bucket of a run with at least min_responses responses."""
    buckets = [b for b in by_length(rows).values() if b["responses"] >= min_responses]
    return [b["tokens"] / b["responses"] for b in buckets], [b[stat] for b in buckets]


def plot(runs: list[tuple[str, list[dict]]], floors: list[tuple[str, list[dict]]], output: str, min_responses: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.6))
    axes = axes.flatten()
    for ax, (stat, title) in zip(axes, PANELS):
        for label, rows in runs:
            ax.plot(*curve(rows, stat, min_responses), marker="o", label=label)
        for (label, rows), color in zip(floors, FLOOR_COLORS):
            if by_length(rows):
                ax.plot(*curve(rows, stat, min_responses), ls="--", marker="x", color=color, label=f"floor: {label}")
            elif stat != "seq_abs_log_ratio":
                ax.axhline(floor_level(rows, stat), ls="--", color=color, label=f"floor: {label}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("response length (tokens)")
        ax.grid(True, alpha=0.3)
    for label, rows in runs:
        axes[-1].plot([r["step"] for r in rows], [r.get("reward/mean") for r in rows], marker="o", label=label)
    for (label, rows), color in zip(floors, FLOOR_COLORS):
        axes[-1].plot(
            [r["step"] for r in rows],
            [r.get("reward/mean") for r in rows],
            ls="--",
            marker="x",
            color=color,
            label=f"floor: {label}",
        )
    axes[-1].set_title("reward (mean)", fontsize=10)
    axes[-1].set_xlabel("GRPO step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", help="LABEL=RUN (run directory or metrics.jsonl)")
    ap.add_argument(
        "--floor", action="append", default=[], help="LABEL=RUN drawn dashed (a floor: bf16, or a second FP8 program)"
    )
    ap.add_argument("-o", "--output", required=True, help="PNG file to write")
    ap.add_argument("--table", help="also write the per-bucket numbers of runs and floors to this markdown file")
    ap.add_argument(
        "--min-responses",
        type=int,
        default=8,
        help="draw only buckets with at least this many responses over all steps (default 8; the table keeps all)",
    )
    a = ap.parse_args(argv)
    try:
        runs, floors = [read_run(s) for s in a.runs], [read_run(s) for s in a.floor]
        for spec, (_, rows) in zip(a.runs, runs):
            if not by_length(rows):
                raise ValueError(f"{spec}: no mismatch/len* buckets (a run from before per-length metrics?)")
        for spec, (_, rows) in zip(a.floor, floors):
            if math.isnan(floor_level(rows, "mean_abs_diff")):
                raise ValueError(f"{spec}: no mismatch/tokens and mismatch/mean_abs_diff rows to draw a floor from")
        if a.min_responses < 1:
            raise ValueError(f"--min-responses {a.min_responses}: give 1 or more (1 draws every bucket)")
        if not any(curve(rows, "tokens", a.min_responses)[0] for _, rows in runs):
            raise ValueError(
                f"every length bucket of the runs has fewer than {a.min_responses} responses: "
                f"lower --min-responses (1 draws every bucket)"
            )
    except ValueError as e:
        print(f"plot_length_mismatch: {e}", file=sys.stderr)
        return 2
    plot(runs, floors, a.output, a.min_responses)
    for left_out in sparse_buckets(runs + floors, a.min_responses):
        print(f"left out of the curves (under --min-responses {a.min_responses}): {left_out}")
    if a.table:
        conf = confidence_table(runs + floors)
        Path(a.table).write_text(table(runs + floors) + ("\n" + conf if conf else ""))
        print(f"wrote {a.table}")
    print(f"wrote {a.output} ({len(runs)} run(s), {len(floors)} floor(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
