"""The length-mismatch experiment (configs/length_mismatch.yaml) scaled down to the CPU: train/rollout mismatch per response-length bucket, jetrl vs the foil.

Both modes run `configs/length_mismatch_cpu.yaml` through the README's launcher from the same seed: a 1-layer
model warm-started for a few SFT steps on the multiplication-trace task, so its responses end anywhere from a
few tokens to max_new_tokens (several length buckets every step), then 3 GRPO steps with the native engine.
Direction, not numbers: jetrl's engine and actor are bit-identical on the CPU (README), so every bucket is exactly
0; the foil (BF16 training, FP8 rollout) is above 0 in every bucket, and, pooled over the steps, long responses
(>= 32 tokens) carry a larger mismatch than short ones (< 16): the sequence-level log importance ratio
|log pi_train(y)/pi_rollout(y)| accumulates along the response (> 2x), the largest token |logp diff| is larger,
and so is the per-token mean |logp diff| (no factor: at this scale it grows little). Margins seen with seeds
7 (this config), 1234, 99 and 2024: sequence log ratio 5.4-9.3x, max 5.7-14x, per-token
mean 1.5-2.2x; seed 1234 sampled only 5 short responses in its 3 steps, one fewer than the pooling asks for. Any
single step is noisier (a bucket of 2 responses), hence the pooling.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_jetrl.rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_length_mismatch", REPO / "tools" / "plot_length_mismatch.py")
plot_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_tool)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of the native engine")
MODES = ("jetrl", "bf16-train-fp8-rollout")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Each mode's run directory and metrics rows (the runs are shared by the tests of this file)."""
    root = tmp_path_factory.mktemp("length_mismatch")
    out = {}
    for mode in MODES:
        d = root / mode
        proc = subprocess.run(
            [
                "bash",
                str(REPO / "launch/train_grpo.sh"),
                "configs/length_mismatch_cpu.yaml",
                f"precision.mode={mode}",
                f"run.name={mode}",
                f"run.out_dir={d}",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHON": sys.executable},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        out[mode] = d, read_metrics(d)
    return out


def buckets(row: dict) -> dict[int, dict[str, float]]:
    """{bucket start: {stat: value}} of one step's `mismatch/len<lo>-<hi>/<stat>` keys."""
    out: dict[int, dict[str, float]] = {}
    for key, value in row.items():
        if key.startswith("mismatch/len"):
            tag, stat = key[len("mismatch/len") :].split("/")
            out.setdefault(int(tag.split("-")[0]), {})[stat] = value
    return dict(sorted(out.items()))


def test_both_modes_log_reward_length_and_several_length_buckets(runs):
    for mode, (_, rows) in runs.items():
        assert [r["step"] for r in rows] == [0, 1, 2] and all(r["mode"] == mode for r in rows)
        for r in rows:
            assert 0 <= r["reward/mean"] <= 1 and r["response_length/mean"] > 1
            b = buckets(r)
            assert len(b) >= 3, f"{mode} step {r['step']}: responses of one length only ({sorted(b)})"
            assert sum(x["responses"] for x in b.values()) == 16 and sum(x["tokens"] for x in b.values()) == r["mismatch/tokens"]


def test_jetrl_is_exactly_zero_in_every_length_bucket(runs):
    for r in runs["jetrl"][1]:
        for start, stats in buckets(r).items():
            assert {k: v for k, v in stats.items() if k not in ("tokens", "responses")} == {
                "mean_abs_diff": 0.0,
                "k3_kl": 0.0,
                "max_abs_diff": 0.0,
                "abs_diff_gt1_frac": 0.0,
                "seq_abs_log_ratio": 0.0,
            }, start


def pooled(per_bucket: dict, keep) -> dict[str, float]:
    """The buckets (lo, hi) with keep(lo, hi) as one: response-weighted sequence |log ratio|, token-weighted mean
    |logp diff|, max |logp diff|."""
    chosen = [b for (lo, hi), b in per_bucket.items() if keep(lo, hi)]
    responses, tokens = sum(b["responses"] for b in chosen), sum(b["tokens"] for b in chosen)
    return {
        "responses": responses,
        "max_abs_diff": max(b["max_abs_diff"] for b in chosen),
        "mean_abs_diff": sum(b["tokens"] * b["mean_abs_diff"] for b in chosen) / tokens,
        "seq_abs_log_ratio": sum(b["responses"] * b["seq_abs_log_ratio"] for b in chosen) / responses,
    }


def test_foil_mismatch_is_above_zero_and_accumulates_with_length(runs):
    rows = runs["bf16-train-fp8-rollout"][1]
    for r in rows:
        b = buckets(r)
        assert all(x["mean_abs_diff"] > 0 and x["max_abs_diff"] > 0 and x["seq_abs_log_ratio"] > 0 for x in b.values()), b
    per_bucket = plot_tool.by_length(rows)  # over the steps
    short, long = pooled(per_bucket, lambda lo, hi: hi <= 16), pooled(per_bucket, lambda lo, hi: lo >= 32)
    assert short["responses"] >= 6 and long["responses"] >= 6, per_bucket
    assert long["seq_abs_log_ratio"] > 2 * short["seq_abs_log_ratio"], (short, long)
    assert long["max_abs_diff"] > short["max_abs_diff"], (short, long)
    assert long["mean_abs_diff"] > short["mean_abs_diff"], (short, long)


def test_plot_of_both_runs(runs, tmp_path):
    out = tmp_path / "length_mismatch.png"
    specs = [f"{mode}={d}" for mode, (d, _) in runs.items()]
    tool = [sys.executable, str(REPO / "tools/plot_length_mismatch.py")]
    proc = subprocess.run([*tool, *specs, "--floor", f"jetrl={runs['jetrl'][0]}", "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr
    bad = subprocess.run(
        [*tool, specs[0], f"nope={tmp_path / 'missing'}", "-o", str(tmp_path / "x.png")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no metrics.jsonl there" in bad.stderr
    assert not (tmp_path / "x.png").exists()
