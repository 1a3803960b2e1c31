"""Train/rollout mismatch per GRPO step, one line per run, with the floors as horizontal lines.

    .venv/bin/python tools/plot_mismatch.py RUN=metrics.jsonl ... [--floor NAME=metrics.jsonl ...] -o out.png

Each RUN is `label=path/to/metrics.jsonl` (a run directory's metrics file). A floor is a run whose mean over steps
is drawn as a dashed line (e.g. the BF16 floor: vLLM-bf16 vs the actor in bf16; the FP8 floor: two programs with
the identical FP8 flow). Three panels: mean |logp diff|, k3 KL, max |logp diff|. Exit 2 on an unreadable file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PANELS = [
    ("mismatch/mean_abs_diff", "mean |logp diff|"),
    ("mismatch/k3_kl", "k3 KL"),
    ("mismatch/max_abs_diff", "max |logp diff|"),
]


def read(spec: str) -> tuple[str, list[dict]]:
    label, _, path = spec.partition("=")
    if not path:
        raise ValueError(f"{spec!r}: write label=path/to/metrics.jsonl")
    try:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read metrics ({e})") from None
    if not rows or any(k not in rows[0] for k, _ in PANELS):
        raise ValueError(f"{path}: no mismatch metrics (is it a GRPO run's metrics.jsonl?)")
    return label, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--floor", action="append", default=[])
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    try:
        runs, floors = [read(s) for s in a.runs], [read(s) for s in a.floor]
    except ValueError as e:
        print(f"plot_mismatch: {e}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    for ax, (key, title) in zip(axes, PANELS):
        for label, rows in runs:
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label=label)
        for (label, rows), color in zip(floors, ("gray", "black", "brown")):
            ax.axhline(statistics.fmean(r[key] for r in rows), ls="--", color=color, label=f"floor: {label}")
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
