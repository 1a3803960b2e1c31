"""The GRPO config: YAML files compose (model preset, then precision mode), overrides win, and every preset
is valid -- FP8/TP alignment of the real architectures checked without their weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_jetrl.rl.config import ConfigError, load_config, split_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODELS = sorted((CONFIGS / "models").glob("*.yaml"))
MODES = sorted((CONFIGS / "modes").glob("*.yaml"))


def test_tiny_default():
    cfg = load_config()
    assert cfg.precision.mode == "jetrl" and cfg.parallel.world_size == 1 and cfg.arch().hidden_size == 256
    assert cfg.model.batch_invariant is None and cfg.rollout.engine == "native"


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.stem)
@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_every_preset_in_every_mode_is_valid(model, mode):
    cfg = load_config([model, mode])
    assert cfg.precision.mode == mode.stem and cfg.run.name == model.stem
    assert cfg.grpo.prompts_per_step * cfg.rollout.n == 256 and cfg.optim.lr == 1e-6 and cfg.loss.kl_coef == 1e-3
    arch = cfg.arch()  # the FP8 alignment at the preset's TP
    assert arch.num_kv_heads % cfg.parallel.tp == 0


def test_files_then_overrides_compose_in_order():
    files, overrides = split_args([str(MODELS[0]), str(MODES[0]), "parallel.tp=1", "run.name=x=y"])
    assert files == [str(MODELS[0]), str(MODES[0])] and overrides == ["parallel.tp=1", "run.name=x=y"]
    cfg = load_config(files, overrides)
    assert cfg.parallel.tp == 1 and cfg.run.name == "x=y" and cfg.precision.mode == MODES[0].stem


def test_one_entry_of_the_hf_config_is_overridden_and_the_others_kept():
    base = load_config(CONFIGS / "gpu_8b_shapes.yaml", ["run.device=cpu"]).model.hf_config
    cfg = load_config(CONFIGS / "gpu_8b_shapes.yaml", ["run.device=cpu", "model.hf_config.num_hidden_layers=28"])
    assert cfg.model.hf_config == {**base, "num_hidden_layers": 28}
    with pytest.raises(ConfigError, match=r"not of the form section.key=value .*model.hf_config.num_hidden_layers=28"):
        load_config(None, ["run.steps.x=1"])  # run.steps is no mapping


def test_misaligned_tp_is_refused_naming_the_layer_and_the_sizes_that_work():
    with pytest.raises(ConfigError, match=r"parallel.tp=8.*"):
        load_config([CONFIGS / "models/qwen2.5-7b.yaml", CONFIGS / "modes/jetrl.yaml"], ["parallel.tp=8"])


def test_preset_must_agree_with_the_checkpoint(tmp_path):
    cfg = load_config([CONFIGS / "models/qwen3-8b-base.yaml"], [f"model.path={tmp_path}"])
    disk = dict(cfg.model.hf_config, num_hidden_layers=48)
    (tmp_path / "config.json").write_text(json.dumps(disk))
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(config 36, checkpoint 48\)"):
        cfg.model.check_path_matches()
    (tmp_path / "config.json").write_text(json.dumps(cfg.model.hf_config))
    cfg.model.check_path_matches()


def test_yaml_exponent_without_a_dot_is_a_number():
    assert load_config(None, ["optim.lr=5e-4"]).optim.lr == 5e-4


def test_a_rollout_split_other_than_the_trainers_is_noted_in_jetrl_only():
    """jetrl with vLLM engines split otherwise than the trainer (rollout.tp != parallel.tp) is valid but noted with
    its measured cost and the fix; the same split in bf16, or the matching one, is not."""
    base = ["rollout.engine=vllm", "parallel.tp=2"]
    cfg = load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=1"])
    notes = cfg.notices()
    assert len(notes) == 1 and "rollout.tp=1 differs from parallel.tp=2" in notes[0] and notes[0].endswith("set rollout.tp=2 for the lowest mismatch")
    assert load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=2"]).notices() == []
    assert load_config(CONFIGS / "gpu_8b_shapes.yaml", base + ["rollout.tp=1", "precision.mode=bf16"]).notices() == []
    assert load_config().notices() == []
