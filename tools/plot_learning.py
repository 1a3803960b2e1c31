#!/usr/bin/env python
"""Learning curves of precision modes side by side (launch/compare_modes.sh) in one PNG, and their numbers as a table.

    .venv/bin/python tools/plot_learning.py LABEL=RUN ... -o curves.png [--table curves.md] [--smooth 10]

RUN is a run directory or its metrics.jsonl. Eight panels, one line per run: the reward per step (thin) and its moving
mean over `--smooth` steps (thick); the greedy accuracy on the held-out problems (`heldout/accuracy`, run.eval_every);
the response length; the train/rollout mismatch, mean |logp diff| per step; the sequence |log pi_train / pi_rollout| by
response length (length buckets pooled over every step, response-weighted, at the bucket's mean length); the spread of
the truncated importance weights min(r, cap) (their standard deviation over a step's tokens: 0 when train and rollout
agree); the PPO clip fraction; and the k3 KL per step. The mismatch panels are on a symmetric-log axis, so a run whose
mismatch is exactly 0 (jetrl with exact logprobs) lies on the 0 line.

The table (`--table`, markdown) has a row per run: steps, reward over the first and the last `--smooth` steps, held-out
accuracy at the first and the last evaluation (and the best), mean |logp diff| and k3 KL over every step, the sequence
|log ratio| of the longest length bucket with at least 8 responses, the mean TIS weight spread, clip fraction and
step time, and the response length over the first and the last steps.

Exit status: 0 written; 2 a run unreadable or without rows (one line says which).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from plot_length_mismatch import by_length, read_run  # noqa: E402

PER_STEP = (
    ("reward/mean", "reward (mean per step)", "linear"),
    ("heldout/accuracy", "held-out accuracy (greedy)", "linear"),
    ("response_length/mean", "response length (tokens)", "linear"),
    ("mismatch/mean_abs_diff", "mismatch: mean |logp train - rollout|", "symlog"),
    (None, "sequence |log pi_train/pi_rollout| by response length", "symlog"),
    ("mismatch/tis_weight_std", "TIS weight spread: std of min(r, cap)", "symlog"),
    ("loss/clip_frac", "clip fraction", "linear"),
    ("mismatch/k3_kl", "mismatch: k3 KL", "symlog"),
)
LINTHRESH = 1e-6  # symlog: linear below this, so that exactly 0 is drawn
MIN_RESPONSES = 8


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `key`."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def moving_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def plot(runs: list[tuple[str, list[dict]]], output: str, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title, scale) in zip(axes.flat, PER_STEP):
        for i, (label, rows) in enumerate(runs):
            color = colors[i % len(colors)]
            if key is None:
                buckets = [b for b in by_length(rows).values() if b["responses"] >= MIN_RESPONSES]
                ax.plot(
                    [b["tokens"] / b["responses"] for b in buckets],
                    [b["seq_abs_log_ratio"] for b in buckets],
                    "o-",
                    color=color,
                    label=label,
                )
                continue
            steps, values = series(rows, key)
            if key == "reward/mean":
                ax.plot(steps, values, color=color, alpha=0.25, lw=0.8)
                ax.plot(steps, moving_mean(values, smooth), color=color, lw=2, label=f"{label} (mean of {smooth})")
            else:
                ax.plot(steps, values, "o-" if key == "heldout/accuracy" else "-", color=color, lw=1.5, ms=4, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("mean response length (tokens)" if key is None else "GRPO step")
        if key is None:
            ax.set_xscale("log", base=2)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=LINTHRESH)
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("GRPO from one warm-start: precision modes side by side", fontsize=12)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=80)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency: a 64-colour palette keeps the PNG small for docs/

    Image.open(output).convert("RGB").quantize(colors=64).save(output, optimize=True)


def summary(rows: list[dict], smooth: int) -> dict[str, float | int | None]:
    """One run's row of the table (module docstring)."""

    def mean(key, part=slice(None)):
        values = series(rows, key)[1][part]
        return statistics.fmean(values) if values else None

    held = series(rows, "heldout/accuracy")[1]
    long = [b for b in by_length(rows).values() if b["responses"] >= MIN_RESPONSES]
    return {
        "steps": len(rows),
        "reward_first": mean("reward/mean", slice(0, smooth)),
        "reward_last": mean("reward/mean", slice(-smooth, None)),
        "heldout_first": held[0] if held else None,
        "heldout_last": held[-1] if held else None,
        "heldout_best": max(held) if held else None,
        "mismatch": mean("mismatch/mean_abs_diff"),
        "k3": mean("mismatch/k3_kl"),
        "seq_log_ratio_longest": long[-1]["seq_abs_log_ratio"] if long else None,
        "longest_bucket_tokens": round(long[-1]["tokens"] / long[-1]["responses"]) if long else None,
        "tis_std": mean("mismatch/tis_weight_std"),
        "clip_frac": mean("loss/clip_frac"),
        "length_first": mean("response_length/mean", slice(0, smooth)),
        "length_last": mean("response_length/mean", slice(-smooth, None)),
        "step_s": mean("time/step"),
    }


def table(runs: list[tuple[str, list[dict]]], smooth: int) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    lines = [
        f"| run | steps | reward (first -> last {smooth}) | held-out acc. (first -> last, best) | mean \\|dlogp\\| | "
        "k3 KL | seq \\|log ratio\\|, longest bucket | TIS weight std | clip frac. | response length | step s |",
        "|---" * 11 + "|",
    ]
    for label, rows in runs:
        s = summary(rows, smooth)
        lines.append(
            f"| {label} | {s['steps']} | {f(s['reward_first'], '.3f')} -> {f(s['reward_last'], '.3f')} | "
            f"{f(s['heldout_first'], '.3f')} -> {f(s['heldout_last'], '.3f')} ({f(s['heldout_best'], '.3f')}) | "
            f"{f(s['mismatch'], '.2e')} | {f(s['k3'], '.2e')} | {f(s['seq_log_ratio_longest'], '.3f')} "
            f"(~{f(s['longest_bucket_tokens'], 'd')} tokens) | {f(s['tis_std'], '.2e')} | {f(s['clip_frac'], '.4f')} | "
            f"{f(s['length_first'], '.0f')} -> {f(s['length_last'], '.0f')} | {f(s['step_s'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", help="LABEL=RUN (run directory or metrics.jsonl)")
    ap.add_argument("-o", "--output", required=True, help="PNG file to write")
    ap.add_argument("--table", help="also write the table of the runs to this markdown file")
    ap.add_argument(
        "--smooth", type=int, default=10, help="steps in the reward's moving mean and the first/last windows (default 10)"
    )
    a = ap.parse_args(argv)
    try:
        if a.smooth < 1:
            raise ValueError(f"--smooth {a.smooth}: give 1 or more steps")
        runs = [read_run(spec) for spec in a.runs]
    except ValueError as e:
        print(f"plot_learning: {e}", file=sys.stderr)
        return 2
    plot(runs, a.output, a.smooth)
    text = table(runs, a.smooth)
    print(text, end="")
    if a.table:
        Path(a.table).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
