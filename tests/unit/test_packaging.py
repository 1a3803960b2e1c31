"""`pip install .` gives a package that runs outside the repository: the megatron-core CPU patch (patches/) and the
configs (configs/, tiny.yaml the default) are package data, found by the code when the repository is not there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "megatron_jetrl").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_installed_package_carries_the_cpu_patch_and_the_configs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("megatron_jetrl", "patches", "configs", "pyproject.toml", "README.md"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, src / name)
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "megatron_jetrl/_patches/megatron_core_0_16_1_cpu.py").is_file()
    assert (target / "megatron_jetrl/_patches/vllm_0_26_0_seeded_sampling.py").is_file()
    assert (target / "megatron_jetrl/_configs/tiny.yaml").is_file()
    assert (target / "megatron_jetrl/_configs/models/qwen2.5-7b.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "from megatron_jetrl.rl.config import DEFAULT_CONFIG, load_config; from megatron_jetrl.patching import load_patch; "
        "print(DEFAULT_CONFIG); load_config(); print(load_patch('megatron_core_0_16_1_cpu').__file__)"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=elsewhere,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    config, patch = r.stdout.split()
    assert config == str(target / "megatron_jetrl/_configs/tiny.yaml")
    assert patch == str(target / "megatron_jetrl/_patches/megatron_core_0_16_1_cpu.py")


def test_a_bare_install_says_what_is_missing_in_one_line(monkeypatch, capsys):
    import pytest

    from megatron_jetrl.rl import extras

    assert extras.missing_train_extras() == []  # this environment has the train extra
    monkeypatch.setitem(extras.TRAIN_EXTRAS, "no_such_module.core", "no-such-package==1.0")
    with pytest.raises(SystemExit) as e:
        extras.require_train_extras("megatron_jetrl.rl.train")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "megatron_jetrl.rl.train needs no-such-package==1.0, not installed here: pip install 'megatron-jetrl[train]' "
        "(from a clone: pip install '.[train]'; on a CPU machine install torch's CPU build first, as tools/setup.sh "
        "does)"
    ]


def test_configs_resolve_from_any_directory_and_help_lists_every_section(tmp_path, monkeypatch):
    import dataclasses
    import typing

    from megatron_jetrl.rl.config import JetRLConfig, config_path, load_config, sections_help

    monkeypatch.chdir(tmp_path)
    for given in ("configs/models/qwen3-8b-base.yaml", "models/qwen3-8b-base.yaml"):
        assert config_path(given) == REPO / "configs" / "models" / "qwen3-8b-base.yaml"
        assert load_config(given).model.hf_config["num_hidden_layers"] == 36
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("run: {name: mine}\n")  # a file where it is given wins
    assert config_path("configs/tiny.yaml") == Path("configs/tiny.yaml")
    text = sections_help()
    for section, cls in typing.get_type_hints(JetRLConfig).items():
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{section}:"))
        assert dataclasses.fields(cls)[0].name in line
        assert all(f.name in text for f in dataclasses.fields(cls))
