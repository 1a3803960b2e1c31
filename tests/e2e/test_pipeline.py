"""GRPO with two pipeline stages (parallel.pp=2, an even split and one with its own last-stage count) on the CPU,
against the same run at PP 1, through the README's launcher.

Both runs start from one warm-started export (`run.steps=0`), so they hold the same weights. At PP 2 each stage converts
its own layers and broadcasts them over its pipeline group (actor/weight_stream.py): the native engine on rank 0, which
holds only the first stage, samples from the whole model, and jetrl's mismatch stays exactly 0. An untied model then
trains bit for bit as at PP 1: every rollout, every loss, the final export. (A tied one differs in the last bit of a few
embedding elements: megatron sums the two stages' embedding gradients after accumulating each over the micro-batches,
PP 1 adds them micro-batch by micro-batch.) The grad norm is a sum of per-stage sums of squares: equal to ~1e-7.
A checkpoint of the same weights exports the same bytes from either layout.
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
UNTIED = "model.hf_config.tie_word_embeddings=false"
GRPO = [
    "run.steps=3",
    "warmup.steps=0",
    "run.save_every=0",
    "grpo.prompts_per_step=8",
    "grpo.micro_batch_size=16",
    "precision.mode=jetrl",
]


def launch(out: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run(
        ["bash", str(REPO / "launch/train_grpo.sh"), "configs/tiny.yaml", f"run.out_dir={out}", *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def weights(out: Path) -> bytes:
    return (out / "export" / "model-00001-of-00001.safetensors").read_bytes()


FOUR_LAYERS = "model.hf_config.num_hidden_layers=4"
LAYOUTS = {"pp1": [], "pp2": ["parallel.pp=2"], "pp2-uneven": ["parallel.pp=2", "parallel.pp_last_layers=1"]}
"""PP 2 splits the 4 layers 2 + 2, or 3 + 1 with the last stage's own count (the stage that also runs the output layer)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    launch(
        root / "sft", UNTIED, FOUR_LAYERS, "run.steps=0", "warmup.steps=12", "precision.mode=bf16"
    )  # rewards that differ within groups
    start = f"model.path={root / 'sft' / 'export'}"
    return {
        name: (root / name, launch(root / name, UNTIED, FOUR_LAYERS, start, *GRPO, *layout)) for name, layout in LAYOUTS.items()
    }


@pytest.mark.parametrize("layout", ["pp2", "pp2-uneven"])
def test_pp2_trains_bit_for_bit_as_pp1(runs, layout):
    (out1, rows1), (out2, rows2) = runs["pp1"], runs[layout]
    assert [r["step"] for r in rows2] == [0, 1, 2] and {r["pp"] for r in rows2} == {2}
    assert any(r["grad_norm"] > 0 for r in rows1)  # the policy did learn something to compare
    for a, b in zip(rows1, rows2):
        for key in ("reward/mean", "response_length/mean", "loss/total", "loss/pg", "sync/bytes", "mismatch/tokens"):
            assert a[key] == b[key], (a["step"], key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6, abs=1e-12)
        assert b["mismatch/mean_abs_diff"] == b["mismatch/max_abs_diff"] == 0.0  # the engine has every stage's bytes
    assert weights(out1) == weights(out2)
    assert sorted(p.name for p in (out2 / "checkpoints").glob("step_*/*")) != sorted(
        p.name for p in (out1 / "checkpoints").glob("step_*/*")
    )
    meta = json.loads(next((out2 / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta.get("pp_last_layers", 0) == (1 if layout == "pp2-uneven" else 0)


def test_a_pp2_checkpoint_of_the_same_weights_exports_the_same_bytes(tmp_path):
    """`run.steps=0` from one export (tied embeddings, the tiny default): the checkpoint each layout writes converts
    to the same HF FP8 bytes."""
    launch(tmp_path / "sft", "run.steps=0", "warmup.steps=1", "precision.mode=bf16")
    start = f"model.path={tmp_path / 'sft' / 'export'}"
    for pp in (1, 2):
        launch(tmp_path / f"pp{pp}", start, "run.steps=0", "warmup.steps=0", "precision.mode=jetrl", f"parallel.pp={pp}")
    assert weights(tmp_path / "pp1") == weights(tmp_path / "pp2")
    stages = {p.name for p in (tmp_path / "pp2" / "checkpoints" / "step_000000").iterdir()}
    assert stages != {p.name for p in (tmp_path / "pp1" / "checkpoints" / "step_000000").iterdir()}, stages


def test_the_random_init_is_the_same_at_every_layout(tmp_path):
    """No model.path: the initial weights are drawn per HF tensor from (run.seed, name) (`actor.hf_import.init_hf_weights`),
    so TP 1, TP 2 and PP 2 start from the same bytes, and another seed from other ones."""
    init = ["run.steps=0", "warmup.steps=0", "precision.mode=jetrl"]
    for name, layout in (("tp1", []), ("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2"]), ("seed", ["run.seed=7"])):
        launch(tmp_path / name, *init, *layout)
    assert weights(tmp_path / "tp1") == weights(tmp_path / "tp2") == weights(tmp_path / "pp2")
    assert weights(tmp_path / "seed") != weights(tmp_path / "tp1")
