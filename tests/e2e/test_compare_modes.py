"""launch/compare_modes.sh on the CPU: one warm-start, two precision modes as two processes side by side, held-out
evaluation, a second launch that resumes both, and the learning-curve report (tools/plot_learning.py).

Tiny shapes (configs/length_mismatch_cpu.yaml: a 1-layer model, multiplication traces, the native engine). Both modes
start from the one SFT export with the same seed, and their rollout engines hold the same FP8 bytes at the start, so
their first rollout and first held-out answers are the same tokens; after that jetrl's mismatch is exactly 0 (one
graph on the CPU) and the foil's is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of the native engine")
MODES = ("jetrl", "bf16-train-fp8-rollout")
ARGS = ["configs/length_mismatch_cpu.yaml", "data.heldout=8", "run.eval_every=2", "run.save_every=1"]


def launch(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "JETRL_GPUS": "0"}
    return subprocess.run(
        ["bash", str(REPO / "launch/compare_modes.sh"), "--modes", " ".join(MODES), "--out", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def rows(out: Path, mode: str) -> list[dict]:
    return [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    first = launch(out, *ARGS, "run.steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = launch(out, *ARGS, "run.steps=3")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return out, first.stdout, second.stdout


def test_one_warm_start_serves_both_modes_and_both_launches(runs):
    out, first, second = runs
    assert "warm-start (bf16 SFT)" in first and "exists, reused" in second
    assert (out / "sft" / "export" / "config.json").is_file() and not (out / "sft" / "metrics.jsonl").exists()
    for mode in MODES:
        assert f"{mode} on the CPU" in first and f"compare_modes.sh: {mode}: done" in second
        assert f"resuming {out / mode} at step 2 of 3" in (out / f"{mode}.log").read_text()
        assert [r["step"] for r in rows(out, mode)] == [0, 1, 2] and {r["mode"] for r in rows(out, mode)} == {mode}


def test_modes_start_from_the_same_policy_and_only_jetrl_is_exact(runs):
    out, _, _ = runs
    jetrl, foil = rows(out, "jetrl"), rows(out, "bf16-train-fp8-rollout")
    for key in ("response_length/mean", "reward/mean", "heldout/response_length", "heldout/accuracy"):
        assert jetrl[0][key] == foil[0][key], key  # the same first rollout and held-out answers
    for r in jetrl:
        assert (r["mismatch/mean_abs_diff"], r["mismatch/tis_weight_mean"], r["mismatch/tis_weight_std"]) == (0.0, 1.0, 0.0)
    assert all(r["mismatch/mean_abs_diff"] > 0 and r["mismatch/tis_weight_std"] > 0 for r in foil)


def test_heldout_scores_at_every_interval_and_the_last_step(runs):
    out, _, _ = runs
    for mode in MODES:
        held = {r["step"]: r for r in rows(out, mode) if "heldout/accuracy" in r}
        assert sorted(held) == [0, 1, 2]  # eval_every=2: steps 0 and 2; step 1 was the last of the first launch
        for r in held.values():
            assert 0 <= r["heldout/accuracy"] <= 1 and 1 <= r["heldout/response_length"] <= 64 and r["time/heldout"] > 0
            buckets = {k: v for k, v in r.items() if k.startswith("heldout/accuracy/len")}
            assert buckets and all(0 <= v <= 1 for v in buckets.values())


def test_report_has_every_mode(runs):
    out, _, second = runs
    assert (out / "learning_curves.png").stat().st_size > 20_000
    table = (out / "learning_curves.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == list(MODES)
    assert table[2].split("|")[2].strip() == "3" and "0.00e+00" in table[2]  # jetrl: 3 steps, mismatch 0
    assert table[2] in second


def test_a_bad_mode_or_config_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "bad"
    env = {**os.environ, "PYTHON": sys.executable, "JETRL_GPUS": "0"}
    bad_mode = subprocess.run(
        ["bash", str(REPO / "launch/compare_modes.sh"), "--modes", "jetrl fp4", "--out", str(out), *ARGS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad_mode.returncode == 2
        and "unknown mode 'fp4': use bf16, bf16-train-fp8-rollout, jetrl or jetrl-exact" in bad_mode.stderr
    )
    no_heldout = launch(out, "--", *ARGS[:1], "run.eval_every=1")
    assert no_heldout.returncode == 2 and "data.heldout=0 holds none out" in no_heldout.stderr
    assert not (out / "sft").exists()
