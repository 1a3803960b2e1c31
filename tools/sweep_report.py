#!/usr/bin/env python
"""Table-4-style report of a TP x precision-mode sweep: median per-phase step times, FP8 speedups over BF16 and the
train/rollout mismatch.

For each run directory (metrics.jsonl from megatron_jetrl.rl.metrics, plus summary.json and the sweep's
sweep_status.json when present) one row: TP, precision mode, status, the median time of each phase (rollout,
eval, update, sync and the whole step) over the timed steps (the first step is skipped as warm-up when a run
has at least 2, and a step profiled with run.profile_step when others remain), median tokens/s of the whole step and of the rollout phase, and the speedup of the run over
the bf16 run at the same TP (> 1 = faster): for the rollout, in rollout tokens/s as the paper's Table 4 (FP8
rollout speedup over BF16 per model and TP); for the update and the whole step, bf16 time / run time.
Rollout tokens/s of a step = throughput/tokens_per_s x time/step / time/rollout (the step's response tokens
over the rollout time).

A run that failed, is missing, has no metrics or did not finish (no summary.json) is a row marked FAILED, a
run the sweep skipped (not enough devices) a row marked skipped, one the config refused (e.g. a TP the model
cannot be split into) a row marked invalid with the config's message: nothing is dropped.

Prints the markdown table and writes <prefix>.md and <prefix>.csv (default prefix: <common parent of the
runs>/sweep_report). Exit status: 0 table written, 1 with --strict when a run failed, 2 bad arguments or the
report cannot be written (one line). Unreadable run files (missing, truncated, corrupt) make that run a FAILED row.

Example:
  python tools/sweep_report.py runs/sweep_tp1_bf16 runs/sweep_tp1_jetrl runs/sweep_tp2_bf16 runs/sweep_tp2_jetrl
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_jetrl.rl.metrics import PHASES, read_metrics  # noqa: E402

MODE_ORDER = ("bf16", "bf16-train-fp8-rollout", "jetrl")
BASELINE = "bf16"
SPEEDUP_PHASES = ("rollout", "update", "step")
_DIR_NAME = re.compile(r"tp(\d+)_(.+)$")


@dataclass
class RunRow:
    directory: str
    tp: int | None
    mode: str | None
    status: str  # ok | failed | skipped | invalid
    reason: str = ""
    steps_total: int = 0
    steps_timed: int = 0
    times: dict = field(default_factory=dict)  # phase -> median seconds (None if never logged)
    tokens_per_s: float | None = None
    rollout_tokens_per_s: float | None = None
    speedup: dict = field(default_factory=dict)  # phase -> float, or None (not computable)
    baseline: str = ""  # why there is no speedup, when there is none
    rollout: str = ""  # the rollout engine and its TP ("vllm tp2"), when the metrics say; "" for older runs
    mismatch: dict = field(default_factory=dict)  # "mean" / "k3" (medians over the timed steps), "max" (over all steps)
    peak_gib: float | None = None  # the most GPU memory any GPU held, from gpu_memory.csv (nvidia-smi samples), if present
    phase_gib: dict = field(
        default_factory=dict
    )  # "rollout" / "update" -> the loop's own peak (memory/<phase>_gib), max over steps

    @property
    def status_text(self) -> str:
        if self.status == "ok":
            return "ok"
        return f"{'FAILED' if self.status == 'failed' else self.status}: {self.reason}" if self.reason else self.status.upper()


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _median(rows: list[dict], key: str) -> float | None:
    vals = [
        float(r[key])
        for r in rows
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]
    return statistics.median(vals) if vals else None


def _rollout_rate(row: dict) -> dict:
    """{"rate": response tokens of the step / rollout seconds} when the row has what it takes."""
    vals = [row.get(k) for k in ("throughput/tokens_per_s", "time/step", "time/rollout")]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in vals):
        return {"rate": vals[0] * vals[1] / vals[2]}
    return {}


def _identity(directory: Path, status: dict | None, summary: dict | None, rows: list[dict]) -> tuple[int | None, str | None]:
    """(tp, mode): what the sweep asked for, else what the run reported, else its config, else its name."""
    sources = [status or {}, summary or {}, rows[-1] if rows else {}]
    config_path = directory / "config.yaml"
    if config_path.is_file():
        try:
            import yaml

            cfg = yaml.safe_load(config_path.read_text()) or {}
            sources.append({"tp": (cfg.get("parallel") or {}).get("tp"), "mode": (cfg.get("precision") or {}).get("mode")})
        except Exception:  # noqa: BLE001 - an unreadable config only loses one fallback
            pass
    m = _DIR_NAME.search(directory.name)
    if m:
        sources.append({"tp": m.group(1), "mode": m.group(2)})
    tp = next((_int(s.get("tp")) for s in sources if _int(s.get("tp")) is not None), None)
    mode = next((str(s["mode"]) for s in sources if s.get("mode")), None)
    return tp, mode


def load_run(directory: str | os.PathLike, warmup: int = 1) -> RunRow:
    d = Path(directory)
    status = _read_json(d / "sweep_status.json")
    summary = _read_json(d / "summary.json")
    rows = read_metrics(d) if d.is_dir() else []
    tp, mode = _identity(d, status, summary, rows)
    row = RunRow(str(directory), tp, mode, "ok", steps_total=len(rows))
    rc = _int(status.get("rc")) if status else None
    if status and status.get("status") in ("skipped", "invalid"):
        row.status = status["status"]
        row.reason = status.get("reason") or ("skipped by the sweep" if row.status == "skipped" else "refused by the config")
        return row
    if not d.is_dir():
        row.status, row.reason = "failed", "run directory missing"
    elif rc is not None and rc != 0:
        row.status, row.reason = "failed", f"exit code {rc}"
    elif status and status.get("status") == "failed":
        row.status, row.reason = "failed", status.get("reason") or "failed"
    elif not rows:
        row.status, row.reason = "failed", "no metrics.jsonl rows"
    elif summary is None:
        damaged = (d / "summary.json").exists()
        row.status, row.reason = (
            "failed",
            ("summary.json unreadable (truncated or corrupt)" if damaged else "no summary.json (run did not finish)"),
        )
    timed = rows[warmup:] if len(rows) > warmup else rows
    timed = [r for r in timed if not r.get("profiled")] or timed  # a profiled step (run.profile_step) runs slower
    row.steps_timed = len(timed)
    row.times = {p: _median(timed, f"time/{p}") for p in PHASES}
    row.tokens_per_s = _median(timed, "throughput/tokens_per_s")
    row.rollout_tokens_per_s = _median([_rollout_rate(r) for r in timed], "rate")
    last = rows[-1] if rows else {}
    if last.get("rollout_engine"):
        row.rollout = f"{last['rollout_engine']} tp{last.get('rollout_tp', 1)}"
    maxes = [r["mismatch/max_abs_diff"] for r in rows if isinstance(r.get("mismatch/max_abs_diff"), (int, float))]
    row.mismatch = {
        "mean": _median(timed, "mismatch/mean_abs_diff"),
        "k3": _median(timed, "mismatch/k3_kl"),
        "max": max(maxes) if maxes else None,
    }
    row.peak_gib = _peak_gib(d / GPU_MEMORY)
    for p in MEMORY_PHASES:
        peaks = [r[f"memory/{p}_gib"] for r in rows if isinstance(r.get(f"memory/{p}_gib"), (int, float))]
        row.phase_gib[p] = max(peaks) if peaks else None
    return row


MEMORY_PHASES = ("rollout", "update")
"""Phases whose peak (the loop's `memory/<phase>_gib`: torch's allocator, the most on any rank) the report shows: the
engine awake, and the actor training."""


GPU_MEMORY = "gpu_memory.csv"
"""Beside a run's metrics: `nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1` while it ran
(tools/gpu/gpu_e2e.sh writes it): every GPU's used MiB, sampled each second."""


def _peak_gib(path: Path) -> float | None:
    """The largest sample of `path` (lines "index, MiB") in GiB; None without the file or a readable sample."""
    try:
        samples = [float(line.split(",")[1]) for line in path.read_text().splitlines() if line.count(",") == 1]
    except (OSError, ValueError):
        return None
    return max(samples) / 1024 if samples else None


def _mode_key(mode: str | None) -> tuple:
    return (MODE_ORDER.index(mode), "") if mode in MODE_ORDER else (len(MODE_ORDER), mode or "")


def build_rows(directories: list[str], warmup: int = 1) -> list[RunRow]:
    rows = [load_run(d, warmup) for d in directories]
    rows.sort(key=lambda r: (r.tp is None, r.tp or 0, r.rollout, _mode_key(r.mode), r.directory))
    for row in rows:
        row.speedup = {p: None for p in SPEEDUP_PHASES}
        if row.status != "ok":
            continue
        base = next(
            (b for b in rows if b.mode == BASELINE and (b.tp, b.rollout) == (row.tp, row.rollout) and b.status == "ok"), None
        )
        if base is None:
            row.baseline = f"no successful {BASELINE} run at TP {row.tp}" + (
                f" with rollout {row.rollout}" if row.rollout else ""
            )
            continue
        for p in SPEEDUP_PHASES:
            if p == "rollout":  # throughput ratio, as the paper's Table 4
                t, b = base.rollout_tokens_per_s, row.rollout_tokens_per_s
            else:
                t, b = row.times.get(p), base.times.get(p)
            if t and b and t > 0 and b > 0:
                row.speedup[p] = b / t
    return rows


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


HEADER = [
    "TP",
    "mode",
    "rollout",
    "status",
    "timed steps",
    *(f"{p} (s)" for p in PHASES),
    "tokens/s",
    "rollout tokens/s",
    *(f"{p} speedup" for p in SPEEDUP_PHASES),
    "mean abs dlogp",
    "k3 KL",
    "max abs dlogp",
    "peak GPU GiB",
    *(f"{p} GiB" for p in MEMORY_PHASES),
]
CAPTION = (
    "Medians over the timed steps (the first step is skipped as warm-up when a run has at least 2, a profiled step "
    "when others remain): time per "
    "phase in seconds, tokens/s of the whole step and of the rollout. Speedup over the "
    f"{BASELINE} run at the same TP (> 1: faster): rollout tokens/s ratio for the rollout (as the paper's "
    f"Table 4), {BASELINE} time / mode time for the update and the whole step; n/a without a successful "
    f"{BASELINE} run at that TP and rollout. Train/rollout mismatch on the response tokens (actor logprobs vs "
    "the engine's): mean |dlogp| and k3 KL are medians over the timed steps, max |dlogp| the largest of all steps. "
    f"Peak GPU memory: the largest per-GPU sample of the run's {GPU_MEMORY}, when it has one; rollout and update "
    "GiB: the most torch's allocator held in that phase on any rank, over all steps (the metrics' memory/*_gib; a "
    "sleeping engine's unmapped bytes left out)."
)


def to_markdown(rows: list[RunRow]) -> str:
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---:", ":---", ":---", ":---"] + ["---:"] * (len(HEADER) - 4)) + "|",
    ]
    for r in rows:
        if r.status == "ok":
            speed = [("n/a" if r.baseline else _cell(r.speedup[p], ".2f", "x")) for p in SPEEDUP_PHASES]
        else:
            speed = ["-"] * len(SPEEDUP_PHASES)
        has_times = r.status not in ("skipped", "invalid") and r.steps_total > 0
        cells = [
            "?" if r.tp is None else str(r.tp),
            r.mode or "?",
            r.rollout or "-",
            r.status_text,
            str(r.steps_timed) if has_times else "-",
            *(_cell(r.times.get(p), ".3f") if has_times else "-" for p in PHASES),
            _cell(r.tokens_per_s, ".1f") if has_times else "-",
            _cell(r.rollout_tokens_per_s, ".1f") if has_times else "-",
            *speed,
            *(_cell(r.mismatch.get(k), ".4g") if has_times else "-" for k in ("mean", "k3", "max")),
            _cell(r.peak_gib, ".1f"),
            *(_cell(r.phase_gib.get(p), ".1f") for p in MEMORY_PHASES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + CAPTION + "\n"


def to_csv(rows: list[RunRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "tp",
            "mode",
            "rollout",
            "status",
            "reason",
            "directory",
            "steps_total",
            "steps_timed",
            *(f"time_{p}" for p in PHASES),
            "tokens_per_s",
            "rollout_tokens_per_s",
            *(f"speedup_{p}" for p in SPEEDUP_PHASES),
            "mismatch_mean_abs",
            "mismatch_k3",
            "mismatch_max_abs",
            "peak_gpu_gib",
            *(f"{p}_gib" for p in MEMORY_PHASES),
        ]
    )

    def num(v):
        return "" if v is None else repr(float(v))

    for r in rows:
        w.writerow(
            [
                "" if r.tp is None else r.tp,
                r.mode or "",
                r.rollout,
                r.status,
                r.reason or r.baseline,
                r.directory,
                r.steps_total,
                r.steps_timed,
                *(num(r.times.get(p)) for p in PHASES),
                num(r.tokens_per_s),
                num(r.rollout_tokens_per_s),
                *(num(r.speedup.get(p)) for p in SPEEDUP_PHASES),
                *(num(r.mismatch.get(k)) for k in ("mean", "k3", "max")),
                num(r.peak_gib),
                *(num(r.phase_gib.get(p)) for p in MEMORY_PHASES),
            ]
        )
    return buf.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, summary.json, sweep_status.json)")
    parser.add_argument("-o", "--output", help="output prefix for .md and .csv (default: <common parent>/sweep_report)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="leading steps left out of the medians when a run has more (default 1)"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a run failed")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    rows = build_rows(args.runs, args.warmup)
    prefix = args.output
    if prefix is None:
        parents = [str(Path(d).resolve().parent) for d in args.runs]
        prefix = str(Path(os.path.commonpath(parents)) / "sweep_report")
    md, table_csv = to_markdown(rows), to_csv(rows)
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        Path(prefix + ".md").write_text(md)
        Path(prefix + ".csv").write_text(table_csv)
    except OSError as e:
        print(f"error: cannot write the report {prefix}.md/.csv: {e}", file=sys.stderr)
        return 2
    print(md, end="")
    print(f"\nwrote {prefix}.md and {prefix}.csv")
    failed = [r for r in rows if r.status == "failed"]
    if failed:
        print(f"{len(failed)} run(s) FAILED: " + ", ".join(f"{r.directory} ({r.reason})" for r in failed), file=sys.stderr)
    return 1 if (failed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
