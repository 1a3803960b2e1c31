"""The GRPO loop end to end on the CPU, through the README's launcher (torchrun, one process per rank)."""

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
SHORT = ["run.steps=3", "warmup.steps=2", "run.save_every=0", "grpo.prompts_per_step=8", "grpo.micro_batch_size=16"]


def launch(tmp_path: Path, name: str, *overrides: str, timeout: int = 300) -> tuple[list[dict], Path]:
    out = tmp_path / name
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "launch/train_grpo.sh"),
            "configs/tiny.yaml",
            f"run.name={name}",
            f"run.out_dir={out}",
            *SHORT,
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, out


@pytest.mark.parametrize("mode", ["jetrl", "bf16", "bf16-train-fp8-rollout"])
def test_each_mode_runs_and_reports_its_mismatch(tmp_path, mode):
    rows, out = launch(tmp_path, f"e2e-{mode}", f"precision.mode={mode}")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["mode"] == mode for r in rows)
    for r in rows:
        assert 0 <= r["reward/mean"] <= 1 and r["response_length/mean"] >= 1 and r["time/step"] > 0
        assert r["sync/bytes"] > 0
    mismatch = [r["mismatch/mean_abs_diff"] for r in rows]
    if mode == "bf16-train-fp8-rollout":  # two forward graphs: FP8 rollout vs BF16 training
        assert min(mismatch) > 0 and min(r["mismatch/max_abs_diff"] for r in rows) > 1e-3
    else:  # one graph: the engine's logprobs are the actor's, bit for bit
        assert mismatch == [0.0, 0.0, 0.0] and all(r["mismatch/k3_kl"] == 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    config = json.loads((out / "export" / "config.json").read_text())
    assert ("quantization_config" in config) == (mode != "bf16")
    verify = (
        subprocess.run(
            [sys.executable, str(REPO / "tools/verify_fp8_checkpoint.py"), str(out / "export"), "--rollout-tp", "1", "2"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if mode != "bf16"
        else None
    )
    assert verify is None or verify.returncode == 0, verify.stdout + verify.stderr


def test_tp2_run_with_two_processes(tmp_path):
    """Also profiles step 1 (`run.profile_step`): every rank writes its phases, and only that row says `profiled`."""
    rows, out = launch(tmp_path, "e2e-tp2", "parallel.tp=2", "run.profile_step=1", "run.profile_phases=rollout,eval,update,sync")
    assert [r["tp"] for r in rows] == [2, 2, 2]
    assert [r.get("profiled", 0) for r in rows] == [0, 1, 0]
    for rank in (0, 1):
        profile = json.loads((out / f"profile_step1_rank{rank}.json").read_text())
        assert profile["rank"] == rank and list(profile["phases"]) == ["sync", "rollout", "eval", "update"]
        for phase in profile["phases"].values():  # a CPU run: aten ops' own time, inside the phase's wall time
            assert 0 < phase["kernel_ms"] <= phase["wall_ms"] * 1.05 and sum(phase["categories"].values()) == pytest.approx(
                phase["kernel_ms"]
            )
    assert not (out / "profile_step0_rank0.json").exists()
    # TP2 all-reduces BF16 partial sums (test_actor_engine_bitwise.py): close to the engine, not its bits
    assert all(0 < r["mismatch/mean_abs_diff"] < 0.05 for r in rows)
    meta = json.loads((out / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["tp"] == 2


def test_a_timing_run_without_checkpoints_writes_none(tmp_path):
    rows, out = launch(tmp_path, "e2e-nockpt", "run.steps=2", "run.checkpoint=false", "run.export=false")
    assert [r["step"] for r in rows] == [0, 1]
    assert not (out / "checkpoints").exists() and not (out / "export").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_larger_logprob_micro_batches_change_no_number(tmp_path):
    """grpo.logprob_micro_batch_size scores the rollouts in passes of 32 sequences instead of 16: on the CPU every kernel
    is batch-invariant, so every loss term, reward and mismatch of every step is the same to the last bit."""
    runs = [
        launch(
            tmp_path,
            f"lp{size}",
            "run.steps=2",
            "run.checkpoint=false",
            "run.export=false",
            f"grpo.logprob_micro_batch_size={size}",
        )[0]
        for size in (0, 32)
    ]
    numbers = [
        [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "sync/", "rollout/"))} for r in rows]
        for rows in runs
    ]
    assert numbers[0] == numbers[1] and len(numbers[0]) == 2
    assert all(r["mismatch/mean_abs_diff"] == 0 for r in runs[1])


def test_offloading_the_actors_state_during_the_rollout_changes_no_number(tmp_path):
    """rollout.offload=optimizer (TP 2: every rank frees and restores its own state; the warm-up's optimizer steps
    come first) and =grads: every number of every step is the run without offload's, and each sync freed the bytes
    it reports (rank 0's gradient buffers and FP8 weight copies, and with `optimizer` its FP32 main params, Adam
    moments and the reference's FP8 bytes)."""
    common = ("parallel.tp=2", "run.steps=3", "run.checkpoint=false", "run.export=false")
    runs = {
        what: launch(tmp_path, f"off-{what}", *common, f"rollout.offload={what}")[0] for what in ("none", "grads", "optimizer")
    }
    numbers = {
        what: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "sync/", "rollout/"))} for r in rows]
        for what, rows in runs.items()
    }
    assert numbers["grads"] == numbers["none"] and numbers["optimizer"] == numbers["none"] and len(numbers["none"]) == 3
    assert all("sync/offload_gib" not in r for r in runs["none"])
    grads, full = ([r["sync/offload_gib"] for r in runs[what]] for what in ("grads", "optimizer"))
    assert min(grads) > 0 and len(set(grads)) == 1  # the FP32 gradient buffers: 4 bytes a parameter
    assert all(f > 3.5 * g for f, g in zip(full, grads))  # + 12 bytes a parameter: main params and both moments
    # the policy's FP8 copies (W and W^T) dropped once streamed into the engine: the same bytes every sync, either way
    dropped = {r["sync/fp8_dropped_gib"] for what in ("grads", "optimizer") for r in runs[what]}
    assert len(dropped) == 1 and dropped.pop() > 0 and all("sync/fp8_dropped_gib" not in r for r in runs["none"])


def test_sequence_parallel_at_tp2_keeps_the_first_steps_numbers(tmp_path):
    """parallel.sequence_parallel at TP 2 (each rank holds half the sequence outside the linears; the FP8 linears
    all-gather it in FP8): step 0, on the initial weights (no warm-up), has the plain TP 2 run's loss, rewards and mismatch to the bit
    (the gathered bytes are the same, and the row-parallel outputs are sums of two either way); the next step differs
    only by the order the norms' gradients were summed in. Its forward overlapped round the ring of ranks
    (`parallel.sp_overlap=ring`) gathers the same bytes and sums the same two partial outputs: every step's numbers are
    the one-collective run's to the bit."""
    common = ("parallel.tp=2", "run.steps=2", "run.checkpoint=false", "run.export=false", "warmup.steps=0")
    plain, _ = launch(tmp_path, "tp2", *common)
    sp, out = launch(tmp_path, "tp2-sp", *common, "parallel.sequence_parallel=true")
    keys = ("loss/total", "reward/mean", "mismatch/mean_abs_diff", "mismatch/max_abs_diff", "response_length/mean")
    assert [sp[0][k] for k in keys] == [plain[0][k] for k in keys]
    assert sp[1]["loss/total"] == pytest.approx(plain[1]["loss/total"], rel=1e-2, abs=1e-4)
    assert "sequence_parallel: true" in (out / "config.yaml").read_text()
    ring, out = launch(tmp_path, "tp2-sp-ring", *common, "parallel.sequence_parallel=true", "parallel.sp_overlap=ring")
    assert [[r[k] for k in (*keys, "grad_norm")] for r in ring] == [[r[k] for k in (*keys, "grad_norm")] for r in sp]
    assert "sp_overlap: ring" in (out / "config.yaml").read_text()
