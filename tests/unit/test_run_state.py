"""A run started again: already complete, resumed with the changes it may take, or refused naming the changed
key -- decided from the run directory before anything is written (rl/run_state.py, rl/preflight.py). The run
directories here are written by hand (a checkpoint's trainer_state.json and manifest are all these checks read); the real
trainer re-running a real run is tests/e2e/test_rerun.py."""

from __future__ import annotations

import json

import pytest

from megatron_jetrl.rl import train
from megatron_jetrl.rl.checkpoints import prune_checkpoints
from megatron_jetrl.rl.config import ConfigError, load_config
from megatron_jetrl.rl.run_state import previous_run


def finished_run(tmp_path, step=3, *overrides, summary=True):
    """A run directory as the trainer leaves it at `step`, trained with `overrides`."""
    out = tmp_path / "run"
    cfg = load_config(None, [f"run.out_dir={out}", f"run.steps={step}", *overrides])
    ckpt = out / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "sampler": {}, "config": cfg.to_dict()}))
    (ckpt / "tp00_pp000.safetensors").write_bytes(b"shard")  # what its manifest lists, at its size: a sound checkpoint
    (ckpt / "meta.json").write_text(json.dumps({"shards": [{"file": "tp00_pp000.safetensors", "bytes": 5, "sha256": ""}]}))
    (out / "config.yaml").write_text("the original config.yaml\n")
    if summary:
        (out / "summary.json").write_text("{}")
    return out


def test_a_finished_run_says_it_is_complete_and_how_to_go_on(tmp_path, capsys):
    out = finished_run(tmp_path)
    assert train.main([f"run.out_dir={out}", "run.steps=3"]) == 0
    said = capsys.readouterr().out
    assert f"{out} is already complete at step 3 (run.steps=3); nothing to train" in said
    assert f"{out}/summary.json" in said and "raise run.steps (e.g. run.steps=6: it resumes at step 3)" in said
    assert "set another run.name" in said


def test_a_changed_hyper_parameter_is_refused_naming_the_key(tmp_path, capsys):
    out = finished_run(tmp_path)
    assert train.main([f"run.out_dir={out}", "run.steps=3", "optim.lr=2e-4"]) == 2
    err = capsys.readouterr().err
    assert "config error:" in err and "optim.lr: trained with 0.0001, now 0.0002" in err and "another run.name" in err
    with pytest.raises(ConfigError, match=r"grpo.updates_per_step: trained with 1, now 2"):  # a run that would resume, too
        previous_run(
            load_config(None, [f"run.out_dir={out}", "run.steps=9", "grpo.updates_per_step=2", "grpo.micro_batch_size=8"])
        )


def test_a_setting_whose_auto_resolves_otherwise_now_is_refused_with_the_override_that_keeps_it(tmp_path):
    """`optim.distributed: auto` follows parallel.dp, which a resume may change: a run trained with ZeRO-1 (DP 2) and
    resumed at DP 1 keeps its optimizer only when told so, and the refusal says how."""
    out = finished_run(tmp_path, 3, "optim.distributed=auto", "parallel.dp=2", "grpo.micro_batch_size=4")
    with pytest.raises(ConfigError) as e:
        previous_run(load_config(None, [f"run.out_dir={out}", "run.steps=9", "optim.distributed=auto"]))
    assert "optim.distributed: trained with True, now False" in str(e.value) and "pass optim.distributed=true" in str(e.value)
    kept = previous_run(load_config(None, [f"run.out_dir={out}", "run.steps=9", "optim.distributed=true"]))
    assert kept.step == 3 and "parallel.dp" in kept.changes


def test_settings_a_resumed_run_may_change_are_applied_and_said(tmp_path):
    out = finished_run(tmp_path)
    cfg = load_config(None, [f"run.out_dir={out}", "run.steps=5", "run.save_every=1", "run.timeout_s=60"])
    prev = previous_run(cfg)
    assert not prev.complete(cfg) and prev.step == 3
    assert prev.resume_message(cfg) == (
        f"resuming {out} at step 3 of 5 (step_000003); applied: run.save_every 20 -> 1, "
        "run.steps 3 -> 5, run.timeout_s 300.0 -> 60.0"
    )


def test_where_the_fp8_weight_bytes_live_may_change_on_resume_the_model_may_not(tmp_path):
    """model.fp8_weight_t and model.bf16_linear_weights move the same bytes between memory and time, precision.gemm_sms
    computes them on fewer SMs: a resume may change them (applied and said); any other model key is another model.
    (A GPU run: on the CPU the run is batch-invariant, and its emulated GEMM takes no gemm_sms.)"""
    out = finished_run(tmp_path, 3, "run.device=cuda")
    cfg = load_config(
        None,
        [
            f"run.out_dir={out}",
            "run.steps=5",
            "model.fp8_weight_t=backward",
            "model.bf16_linear_weights=keep",
            "precision.gemm_sms=120",
            "run.device=cuda",
        ],
    )
    assert previous_run(cfg).resume_message(cfg) == (
        f"resuming {out} at step 3 of 5 (step_000003); applied: "
        "model.bf16_linear_weights 'release' -> 'keep', model.fp8_weight_t 'step' -> "
        "'backward', precision.gemm_sms 0 -> 120, run.steps 3 -> 5"
    )
    with pytest.raises(ConfigError, match=r"another model or precision section \(model.fused\)"):
        previous_run(load_config(None, [f"run.out_dir={out}", "run.steps=5", "model.fused=false", "run.device=cuda"]))


def test_a_refused_resume_writes_nothing(tmp_path, capsys):
    out = finished_run(tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert train.main([f"run.out_dir={out}", "run.steps=6", "precision.mode=bf16"]) == 2
    assert (
        "another model or precision section (precision.backend, precision.mode)" in capsys.readouterr().err
    )  # jetrl's batch-invariant CPU run pins the emulated GEMM
    assert (out / "config.yaml").read_text() == "the original config.yaml\n"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_resume_never_is_refused_before_anything(tmp_path):
    out = finished_run(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(step_000003\) and run.resume='never'"):
        previous_run(load_config(None, [f"run.out_dir={out}", "run.resume=never"]))


def test_a_run_stopped_in_its_export_is_not_complete(tmp_path):
    out = finished_run(tmp_path, summary=False)
    cfg = load_config(None, [f"run.out_dir={out}", "run.steps=3"])
    assert not previous_run(cfg).complete(cfg)  # it resumes, trains 0 steps and writes the export and summary


def test_keep_checkpoints_is_validated_and_pruning_keeps_the_newest(tmp_path):
    with pytest.raises(ConfigError, match=r"run.keep_checkpoints must be >= 0 \(0: keep every checkpoint\), got -1"):
        load_config(None, ["run.keep_checkpoints=-1"])
    assert load_config().run.keep_checkpoints == 3
    for step in range(1, 6):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    (tmp_path / "step_000006.partial").mkdir()  # unfinished: not counted, not touched
    (tmp_path / "step_000007").mkdir()  # no trainer_state.json: not complete, not touched
    assert [p.name for p in prune_checkpoints(tmp_path, 0)] == []
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == ["step_000001", "step_000002", "step_000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005", "step_000006.partial", "step_000007"]
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_000004"]


def test_the_output_check_creates_no_checkpoints_folder(tmp_path, monkeypatch):
    from megatron_jetrl.rl import checkpoints

    monkeypatch.setattr(checkpoints.dist, "get_rank", lambda: 0)
    cfg = load_config(None, [f"run.out_dir={tmp_path / 'fresh'}"])
    checkpoints.check_output_space(cfg)
    assert not (tmp_path / "fresh").exists() and list(tmp_path.iterdir()) == []
