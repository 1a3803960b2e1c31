"""A finished run started again, through the README's launcher on the real trainer: it says it is complete (and
trains nothing), refuses changed hyper-parameters before torchrun without touching the run directory, keeps the
newest run.keep_checkpoints checkpoints, exports a usable HF directory (tokenizer included), and extends when
run.steps grows. One short run, shared by the tests of this module (they run in file order; the last extends it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of the embedded default")
SHORT = [
    "run.steps=3",
    "warmup.steps=2",
    "run.save_every=1",
    "run.keep_checkpoints=2",
    "grpo.prompts_per_step=8",
    "grpo.micro_batch_size=16",
]
CLEAN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "JETRL_TRAIN_MODULE", "JETRL_CONFIG_MODULE", "JETRL_NPROC", "JETRL_EXIT_DIR")


def launch(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN} | {"PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(REPO / "launch/train_grpo.sh"), "configs/tiny.yaml", f"run.out_dir={out}", *SHORT, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rerun") / "tiny"
    r = launch(out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "not installed" not in r.stderr  # megatron's TE/Apex warnings are not shown on CPU
    listed = "metrics.jsonl, tb/, checkpoints/, export/, summary.json, config.yaml"
    assert f"  run directory    {out}: {listed}" in r.stdout.splitlines(), r.stdout[-2000:]
    return out


def snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}


def test_a_second_start_says_the_run_is_complete(run):
    before = snapshot(run)
    r = launch(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{run} is already complete at step 3 (run.steps=3); nothing to train" in r.stdout
    assert "raise run.steps" in r.stdout and "another run.name" in r.stdout
    assert "GRPO jetrl" not in r.stderr and "GRPO run:" not in r.stdout  # no step, no old summary
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "override, named",
    [
        ("optim.lr=2e-4", "optim.lr: trained with 0.0001, now 0.0002"),
        (
            "precision.mode=bf16",
            "another model or precision section (precision.backend, precision.mode)",
        ),  # resolved: jetrl pins emulated on CPU
    ],
)
def test_a_changed_setting_is_refused_before_torchrun_and_writes_nothing(run, override, named):
    before = snapshot(run)
    r = launch(run, override)
    assert r.returncode == 2 and "process(es)" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error:") and named in last, last
    assert snapshot(run) == before


def test_keep_last_checkpoints_and_a_usable_export(run):
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    from transformers import AutoTokenizer

    from megatron_jetrl.grpo.tokenizer import SentencePieceTokenizer

    hf = AutoTokenizer.from_pretrained(str(run / "export"), local_files_only=True)
    sp = SentencePieceTokenizer(run / "tokenizer.model")
    assert hf.encode("12+34=", add_special_tokens=False) == sp.encode("12+34=")
    assert json.loads((run / "export" / "config.json").read_text())["model_type"] == "qwen2"


def test_raising_run_steps_resumes_and_says_what_it_applies(run):
    r = launch(run, "run.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming {run} at step 3 of 4 (step_000003); applied: run.steps 3 -> 4" in r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
