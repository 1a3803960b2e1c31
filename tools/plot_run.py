#!/usr/bin/env python
"""Plot GRPO runs from their metrics.jsonl into one PNG: reward, response length, mismatch, per-phase times.

One panel per metric (reward mean with a +-std band, response length, tokens/s, train/rollout mismatch: mean
|logprob diff|, k3 KL and max |logprob diff|, time of each phase: rollout, eval, update, sync, whole step, and
the policy loss), every run overlaid in its own colour, labelled by run name, precision mode and TP. A metric a
run never logged is left out of that run's line; a panel no run has says so.

Exit status: 0 written, 2 no readable metrics in any run or the PNG cannot be written (one line, nothing written).

Example:
  python tools/plot_run.py runs/sweep_tp1_bf16 runs/sweep_tp1_bf16-train-fp8-rollout runs/sweep_tp1_jetrl -o tp1.png
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_jetrl.rl.metrics import read_metrics  # noqa: E402

PANELS = (
    ("reward/mean", "reward (mean, +-std)"),
    ("response_length/mean", "response length (tokens)"),
    ("throughput/tokens_per_s", "throughput (tokens/s)"),
    ("mismatch/mean_abs_diff", "mismatch: mean |logp train - rollout|"),
    ("mismatch/k3_kl", "mismatch: k3 KL"),
    ("mismatch/max_abs_diff", "mismatch: max |logp diff|"),
    ("time/rollout", "time: rollout (s)"),
    ("time/eval", "time: eval (s)"),
    ("time/update", "time: update (s)"),
    ("time/sync", "time: sync (s)"),
    ("time/step", "time: whole step (s)"),
    ("loss/pg", "policy loss"),
)
COLUMNS = 3


def run_label(directory: Path, rows: list[dict]) -> str:
    last = rows[-1] if rows else {}
    parts = [directory.name]
    extra = []
    if last.get("mode") and str(last["mode"]) not in directory.name:
        extra.append(str(last["mode"]))
    if last.get("tp") is not None and f"tp{last['tp']}" not in directory.name:
        extra.append(f"TP{last['tp']}")
    if extra:
        parts.append("(" + ", ".join(extra) + ")")
    return " ".join(parts)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def reward_band(rows: list[dict], xs: list[int], ys: list[float]) -> tuple[list[float], list[float]]:
    """The reward's mean +- std band at steps `xs`, clipped to [0, 1] (a reward is a pass rate: it never leaves it)."""
    sx, sd = series(rows, "reward/std")
    std = dict(zip(sx, sd))
    lo = [max(0.0, y - std.get(x, 0.0)) for x, y in zip(xs, ys)]
    hi = [min(1.0, y + std.get(x, 0.0)) for x, y in zip(xs, ys)]
    return lo, hi


def plot(run_dirs: list[str], output: str, title: str | None = None) -> list[str]:
    """Write the PNG; returns the runs left out (no metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs, empty = [], []
    for d in run_dirs:
        rows = read_metrics(d)
        path = Path(d)
        (runs if rows else empty).append((path if path.is_dir() or not path.exists() else path.parent, rows))
    if not runs:
        raise ValueError("no run has metrics.jsonl rows: " + ", ".join(run_dirs))
    rows_n = math.ceil(len(PANELS) / COLUMNS)
    fig, axes = plt.subplots(rows_n, COLUMNS, figsize=(5.2 * COLUMNS, 3.4 * rows_n), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = {}
    for i, (key, name) in enumerate(PANELS):
        ax = axes[i // COLUMNS][i % COLUMNS]
        drawn = False
        for j, (d, rows) in enumerate(runs):
            xs, ys = series(rows, key)
            if not xs:
                continue
            color = colors[j % len(colors)]
            label = run_label(d, rows)
            (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, color=color, label=label)
            handles.setdefault(label, line)
            if key == "reward/mean":
                lo, hi = reward_band(rows, xs, ys)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
            drawn = True
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for k in range(len(PANELS), rows_n * COLUMNS):
        axes[k // COLUMNS][k % COLUMNS].axis("off")
    height = 3.4 * rows_n
    title_in = 0.45 if title else 0.1
    legend_in = 0.28 * math.ceil(len(handles) / 3) + 0.1
    if title:
        fig.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=12)
    fig.legend(
        list(handles.values()),
        list(handles.keys()),
        loc="upper center",
        ncol=min(len(handles), 3),
        bbox_to_anchor=(0.5, 1 - title_in / height),
        fontsize=9,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - (title_in + legend_in) / height))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return [str(d) for d, _ in empty]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl (or the files themselves)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        empty = plot(args.runs, args.output, args.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    for d in empty:
        print(f"warning: {d}: no metrics.jsonl rows, left out of the plot", file=sys.stderr)
    print(f"wrote {args.output} ({len(args.runs) - len(empty)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
