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
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "megatron_jetrl/_patches/megatron_core_0_16_1_cpu.py").is_file()
    assert (target / "megatron_jetrl/_patches/vllm_0_26_0_seeded_sampling.py").is_file()
    assert (target / "megatron_jetrl/_configs/tiny.yaml").is_file()
    assert (target / "megatron_jetrl/_configs/models/qwen2.5-7b.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("from megatron_jetrl.rl.config import DEFAULT_CONFIG, load_config; from megatron_jetrl.patching import load_patch; "
             "print(DEFAULT_CONFIG); load_config(); print(load_patch('megatron_core_0_16_1_cpu').__file__)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    config, patch = r.stdout.split()
    assert config == str(target / "megatron_jetrl/_configs/tiny.yaml")
    assert patch == str(target / "megatron_jetrl/_patches/megatron_core_0_16_1_cpu.py")
