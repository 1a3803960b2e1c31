"""Compare GRPO runs of the local spec and the TE spec (tools/gpu/gpu_te.sh train): one markdown table.

    python tools/bench/te_compare.py OUT/train_local OUT/train_te

Each directory is a `tools/gpu/gpu_grpo_run.sh` output (`gpu_<mode>.metrics.jsonl` per precision mode). Both specs start
from the same weights (a random init is drawn per HF tensor, the same in both specs: `actor.hf_import.init_hf_weights`) and see the same
prompts and sampling seeds, so step 0's loss and mismatch compare like for like; later steps drift apart as soon as a
sampled token differs. Times are means over steps 1.. (step 0 pays warm-up); `te/local` is the step-time ratio.
Exit 2 when a directory holds no metrics.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PHASES = ("rollout", "eval", "update", "sync", "step")


def runs(directory: Path) -> dict[str, list[dict]]:
    out = {}
    for f in sorted(directory.glob("gpu_*.metrics.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if rows:
            out[f.name.removeprefix("gpu_").removesuffix(".metrics.jsonl")] = rows
    return out


def mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.fmean(vals) if vals else None


def fmt(v, spec=".4g") -> str:
    return "n/a" if v is None else format(v, spec)


def table(local: dict[str, list[dict]], te: dict[str, list[dict]]) -> str:
    lines = [
        "| mode | spec | steps | step-0 loss | step-0 mismatch mean abs dlogp | mean loss | mean mismatch | max abs dlogp | "
        + " | ".join(f"{p} s" for p in PHASES)
        + " | step te/local |",
        "|" + "---|" * (9 + len(PHASES)),
    ]
    for mode in sorted(set(local) | set(te)):
        base = mean(local.get(mode, [])[1:], "time/step")
        for spec, rows in (("local", local.get(mode)), ("te", te.get(mode))):
            if not rows:
                lines.append(f"| {mode} | {spec} | 0 (failed: see run.log) |" + " |" * (6 + len(PHASES)))
                continue
            later = rows[1:] or rows
            step = mean(later, "time/step")
            ratio = fmt(step / base, ".2f") + "x" if spec == "te" and step and base else ""
            lines.append(
                f"| {mode} | {spec} | {len(rows)} | {fmt(rows[0].get('loss/total'))} | {fmt(rows[0].get('mismatch/mean_abs_diff'))} | "
                f"{fmt(mean(rows, 'loss/total'))} | {fmt(mean(rows, 'mismatch/mean_abs_diff'))} | "
                f"{fmt(max((r.get('mismatch/max_abs_diff') or 0) for r in rows), '.3g')} | "
                + " | ".join(fmt(mean(later, f"time/{p}"), ".3f") for p in PHASES)
                + f" | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    local, te = runs(Path(argv[0])), runs(Path(argv[1]))
    if not local and not te:
        print(f"no gpu_*.metrics.jsonl in {argv[0]} or {argv[1]}", file=sys.stderr)
        return 2
    print(table(local, te))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
