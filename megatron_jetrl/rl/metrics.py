"""Per-step metrics of a GRPO run: `metrics.jsonl`, TensorBoard scalars, a progress bar and a printed summary.

The run directory holds `metrics.jsonl`: one JSON object per optimizer step, written by rank 0 only, e.g.

    {"step": 3, "reward/mean": 0.41, "reward/std": 0.3, "response_length/mean": 11.2,
     "mismatch/mean_abs_diff": 0.0, "mismatch/k3_kl": 0.0, "mismatch/max_abs_diff": 0.0,
     "loss/pg": -0.02, "loss/kl": 0.001, "grad_norm": 0.8, "time/rollout": 1.2, "time/eval": 0.3,
     "time/update": 0.9, "time/sync": 0.05, "time/step": 2.5, "throughput/tokens_per_s": 310.0,
     "mode": "jetrl", "tp": 2, "pp": 1, "dp": 1, "rollout_engine": "native", "rollout_tp": 1}

Lines also carry `mismatch/len<lo>-<hi>/*`, the mismatch per response-length bucket (rollout/metrics.py), for the
buckets that hold responses that step. Each line is flushed and fsync'ed as it is written, so a killed run keeps every finished step. Non-finite
floats are written as `null` (strict JSON; `jq` and every reader accept it). A resumed run passes the first
step it will log as `resume_step`: lines with `step >= resume_step` are dropped on open, so the file never
holds a step twice (the default 0 starts the file afresh; the lines dropped are reported on stderr).

Readers (`read_metrics`, tools/plot_run.py, tools/sweep_report.py) skip a torn last line and keep the last
line of a step that somehow appears twice.

`progress()` shows a tqdm bar on a terminal and, off a terminal (SLURM output files, CI logs), prints one plain
line at the first step, at most every 10 s after and at the last step. `summarize()` is summary.json, `format_summary()` the printed table.

This module imports nothing heavy: torch's `SummaryWriter` is imported lazily, only by a writer that logs
to TensorBoard, and tqdm only by a progress bar shown on a terminal.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PHASES = ("rollout", "eval", "update", "sync", "step")
"""Per-phase step times, keys `time/<phase>` in seconds; `step` is the whole step."""
REWARD_WINDOW = 10
"""Steps averaged at each end of a run for the headline reward (summary.json, format_summary)."""

METRIC_KEYS = (
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "mismatch/mean_abs_diff",
    "mismatch/k3_kl",
    "mismatch/max_abs_diff",
    "loss/pg",
    "loss/kl",
    "grad_norm",
    *(f"time/{p}" for p in PHASES),
    "throughput/tokens_per_s",
)
"""The numeric keys every line of metrics.jsonl carries (besides `step`, `mode`, `tp`, `pp`, `dp`, `rollout_engine`,
`rollout_tp`)."""

_TB_SKIP = frozenset({"step", "tp", "pp", "dp", "rollout_tp"})


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors/numpy scalars -> Python numbers, non-finite floats -> None."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _parse_lines(text: str) -> tuple[list[dict], int]:
    """(rows, number of unreadable lines) of a metrics.jsonl text."""
    rows, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            bad += 1
            continue
        rows.append(row)
    return rows, bad


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a run's metrics.jsonl (`path` is the file or its run directory), sorted by step.

    A torn or unreadable line (a run killed while writing) is skipped; a step that appears twice keeps its
    last line. A missing file gives an empty list.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    rows, _ = _parse_lines(path.read_text(encoding="utf-8", errors="replace"))
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


class MetricsWriter:
    """Append one JSON line per step to `<out_dir>/metrics.jsonl` and the scalars to `<out_dir>/tb/`.

    Only the writer built with `enabled=True` touches the disk (pass `enabled=(rank == 0)`); on the other
    ranks every method is a no-op. `resume_step` is the first step this run will log: existing lines with
    `step >= resume_step` are dropped (and TensorBoard is told to purge them, through SummaryWriter's
    `purge_step`), so a resumed run leaves no duplicate steps; the default 0 starts afresh.
    """

    def __init__(self, out_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True, resume_step: int = 0):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / METRICS_FILE
        self.enabled = enabled
        self.resume_step = int(resume_step)
        self._file = None
        self._tb = None
        self._last_step: int | None = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_from(self.resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / TB_DIR), purge_step=self.resume_step)

    def _truncate_from(self, step: int) -> None:
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8", errors="replace")
        rows, bad = _parse_lines(text)
        kept = [r for r in rows if r["step"] < step]
        if kept:
            self._last_step = max(r["step"] for r in kept)
        dropped = len(rows) - len(kept)
        if not dropped and not bad and (not text or text.endswith("\n")):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        what = f"{dropped} line(s) with step >= {step}" + (f" and {bad} unreadable line(s)" if bad else "")
        print(
            f"metrics: {self.path}: dropped {what}; kept {len(kept)} ("
            f"{'resuming at step ' + str(step) if step > 0 else 'fresh run'})",
            file=sys.stderr,
        )

    def write(self, row: Mapping[str, Any]) -> None:
        """Append one step's metrics; `row["step"]` (int) must be larger than the previous step written."""
        if not self.enabled:
            return
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            step = _plain(step)
            if not isinstance(step, int):
                raise ValueError(f"metrics row needs an integer 'step', got {row.get('step')!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"metrics step {step} after step {self._last_step} in {self.path}: steps must increase "
                f"(a resumed run passes resume_step=<first step it logs> so older lines are dropped)"
            )
        clean = {"step": step}
        for key, value in row.items():
            if key != "step":
                clean[str(key)] = _plain(value)
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_step = step
        if self._tb is not None:
            for key, value in clean.items():
                if key in _TB_SKIP or value is None or isinstance(value, str):
                    continue
                if isinstance(value, (bool, int, float)):
                    self._tb.add_scalar(key, float(value), global_step=step)
            self._tb.flush()

    def on_step_end(self, run, row: Mapping[str, Any]) -> None:
        """A subscriber of the run context (rl/context.py): each step's row is written."""
        self.write(row)

    def on_end(self, run) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress:
    """Step progress: a tqdm bar on a terminal; elsewhere (SLURM output files, CI logs) one plain line at the first
    step, then at most every `interval` seconds, and at the last step, e.g. `GRPO jetrl: 6/12 steps, 14 s, 2.3 s/step, reward=0.41`
    (`interval=None`: silent off a terminal)."""

    def __init__(self, total: int, desc: str = "", *, enabled: bool = True, stream=None, interval: float | None = 10.0):
        self._stream = stream if stream is not None else sys.stderr
        self._bar = None
        self._log = False
        self.total, self.desc, self.interval = total, desc, interval
        self.done = 0
        self._start = self._last = time.monotonic()
        if not enabled:
            return
        if getattr(self._stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is in requirements
                return
            self._bar = tqdm(total=total, desc=desc, file=self._stream, dynamic_ncols=True, unit="step")
        elif interval is not None:
            self._log = True

    @property
    def active(self) -> bool:
        return self._bar is not None or self._log

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        if self._bar is not None:
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(n)
        elif self._log:
            now = time.monotonic()
            if self.done == n or now - self._last >= self.interval or self.done >= self.total:
                self._last = now
                elapsed = now - self._start
                rate = f", {elapsed / self.done:.3g} s/step" if self.done else ""
                extra = "".join(f", {k}={v}" for k, v in shown.items())
                print(
                    f"{self.desc + ': ' if self.desc else ''}{self.done}/{self.total} steps, {elapsed:.0f} s{rate}{extra}",
                    file=self._stream,
                    flush=True,
                )

    def on_step_end(self, run, row: Mapping[str, Any]) -> None:
        """A subscriber of the run context (rl/context.py): one step, with its reward and train/rollout mismatch."""
        self.update(1, reward=f"{row['reward/mean']:.3f}", mismatch=f"{row.get('mismatch/mean_abs_diff', 0):.2g}")

    def on_end(self, run) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._log = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str = "", *, enabled: bool = True, stream=None, interval: float | None = 10.0) -> Progress:
    """Progress over `total` steps (pass `enabled=(rank == 0)`): a bar on a terminal, else a line every `interval` s."""
    return Progress(total, desc, enabled=enabled, stream=stream, interval=interval)


def _values(rows: Iterable[Mapping], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _first_last(rows: list[Mapping], key: str) -> tuple[float | None, float | None]:
    vals = _values(rows, key)
    return (vals[0], vals[-1]) if vals else (None, None)


def _window_means(rows: list[Mapping], key: str, window: int) -> dict:
    """{"first", "last": mean of the first / last `window` logged values, "window": values in each} (a single
    step of a noisy metric says little)."""
    vals = _values(rows, key)
    n = min(window, len(vals))
    return {"first": _mean(vals[:n]), "last": _mean(vals[-n:]) if n else None, "window": n}


def _mean(vals: list[float]) -> float | None:
    return statistics.fmean(vals) if vals else None


def _constant(rows: list[Mapping], key: str):
    for r in reversed(rows):
        if r.get(key) is not None:
            return r[key]
    return None


def summarize(rows: list[Mapping]) -> dict:
    """The `summary.json` of a run from its metrics rows (None where a metric was never logged).

    {"steps", "mode", "tp", "pp", "dp", "reward": {"first", "last", "window"} (means of the first / last
     `window` = min(10, steps) steps), "response_length": {"first", "last"} (single steps),
     "mismatch": {"mean_abs_diff": mean, "k3_kl": mean, "max_abs_diff": max}, "time": {phase: mean seconds},
     "throughput_tokens_per_s": mean}
    """
    rows = list(rows)
    length = _first_last(rows, "response_length/mean")
    max_abs = _values(rows, "mismatch/max_abs_diff")
    return {
        "steps": len(rows),
        "mode": _constant(rows, "mode"),
        "tp": _constant(rows, "tp"),
        "pp": _constant(rows, "pp"),
        "dp": _constant(rows, "dp"),
        "reward": _window_means(rows, "reward/mean", REWARD_WINDOW),
        "response_length": {"first": length[0], "last": length[1]},
        "mismatch": {
            "mean_abs_diff": _mean(_values(rows, "mismatch/mean_abs_diff")),
            "k3_kl": _mean(_values(rows, "mismatch/k3_kl")),
            "max_abs_diff": max(max_abs) if max_abs else None,
        },
        "time": {p: _mean(_values(rows, f"time/{p}")) for p in PHASES},
        "throughput_tokens_per_s": _mean(_values(rows, "throughput/tokens_per_s")),
    }


def _fmt(value: float | None, spec: str = ".4g", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_summary(rows: list[Mapping]) -> str:
    """A short human table of a run: reward (mean of the first -> last 10 steps), response length, mismatch, mean
    per-phase times.

    GRPO run: 3 steps, mode jetrl, TP 2 PP 1 DP 1
      reward           0.25 -> 0.5  (mean of the first -> last 3 steps)
      response length  12 -> 10.5
      mismatch         mean |logp diff| 0, k3 KL 0, max |logp diff| 0
      time/step (s)    rollout 1.2 | eval 0.1 | update 0.8 | sync 0.05 | total 2.15  (mean of 3 steps)
      throughput       320 tokens/s
    """
    s = summarize(rows)
    if not s["steps"]:
        return "GRPO run: no steps logged"
    layout = " ".join(f"{k.upper()} {s[k]}" for k in ("tp", "pp", "dp") if s[k] is not None)
    head = f"GRPO run: {s['steps']} step{'s' if s['steps'] != 1 else ''}"
    if s["mode"] is not None:
        head += f", mode {s['mode']}"
    if layout:
        head += f", {layout}"
    m = s["mismatch"]
    times = " | ".join(f"{'total' if p == 'step' else p} {_fmt(s['time'][p], '.3g')}" for p in PHASES)
    lines = [
        head,
        f"  reward           {_fmt(s['reward']['first'])} -> {_fmt(s['reward']['last'])}  "
        f"(mean of the first -> last {s['reward']['window']} step{'s' if s['reward']['window'] != 1 else ''})",
        f"  response length  {_fmt(s['response_length']['first'])} -> {_fmt(s['response_length']['last'])}",
        f"  mismatch         mean |logp diff| {_fmt(m['mean_abs_diff'])}, k3 KL {_fmt(m['k3_kl'])}, "
        f"max |logp diff| {_fmt(m['max_abs_diff'])}",
        f"  time/step (s)    {times}  (mean of {s['steps']} step{'s' if s['steps'] != 1 else ''})",
        f"  throughput       {_fmt(s['throughput_tokens_per_s'], '.4g', ' tokens/s')}",
    ]
    return "\n".join(lines)


__all__ = [
    "METRICS_FILE",
    "METRIC_KEYS",
    "PHASES",
    "TB_DIR",
    "MetricsWriter",
    "Progress",
    "format_summary",
    "progress",
    "read_metrics",
    "summarize",
]
