"""Configurations this machine, these inputs or this run directory cannot run are refused by the config check, in
seconds, in one line naming the key and the fix (rl/preflight.py) -- not after torchrun, the warm-start, a
checkpoint or an export. The launcher's last line is that message."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_jetrl.rl import preflight
from megatron_jetrl.rl.config import ConfigError, load_config
from megatron_jetrl.rollout.vllm_engine import VLLM_VERSION

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "train_grpo.sh"
CLEAN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "JETRL_TRAIN_MODULE", "JETRL_CONFIG_MODULE", "JETRL_NPROC", "JETRL_EXIT_DIR")


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """runs/<name> of these configs: under tmp_path, not the repository's runs/."""
    monkeypatch.chdir(tmp_path)


def refused(*overrides, match: str):
    with pytest.raises(ConfigError, match=match):
        preflight.check(load_config(None, list(overrides)))


@pytest.fixture
def gpu(monkeypatch):
    """This machine as a GPU node (the vLLM checks come after the device check)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_vllm_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused("rollout.engine=vllm", match=rf"rollout.engine=vllm needs a CUDA GPU and this run is on the cpu: set rollout.engine=native, "
                                         rf"or run on a GPU node with vLLM \(pip install vllm=={VLLM_VERSION}\)")


def test_vllm_not_installed_names_the_install_line(gpu, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    refused("rollout.engine=vllm", match=rf"vLLM is not installed in this environment: pip install vllm=={VLLM_VERSION}, or set rollout.engine=native")


def test_vllm_of_another_version_is_refused(gpu, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.0")
    refused("rollout.engine=vllm", match=rf"needs vLLM {VLLM_VERSION} .*found 0.33.0: pip install vllm=={VLLM_VERSION}")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: VLLM_VERSION)
    preflight.check_vllm(load_config(None, ["rollout.engine=vllm"]), "cuda")  # the pinned version passes


def test_an_fp8_backend_this_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused("precision.backend=triton", match=r"precision.backend='triton' is not available on this machine's cpu .*set precision.backend=auto")


def hf_dir(tmp_path: Path, model_type="qwen2", weights=True, tokenizer=True) -> Path:
    cfg = load_config()
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg.model.hf_config, "model_type": model_type}))
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_model_path_problems(tmp_path):
    refused(f"model.path={tmp_path / 'nope'}", match=r"model.path='.*nope' does not exist or is not a directory: point it at a local HF model")
    refused(f"model.path={tmp_path}", match=r"has no config.json: point it at a local HF model directory")
    d = hf_dir(tmp_path, model_type="gpt2")
    refused(f"model.path={d}", match=r"holds a 'gpt2' model; megatron-jetrl supports model_type \['llama', 'qwen2', 'qwen3'\]")
    (d / "config.json").write_text("{trunc")
    refused(f"model.path={d}", match=r"config.json is unreadable")


def test_model_path_without_weights_or_tokenizer(tmp_path):
    d = hf_dir(tmp_path, weights=False, tokenizer=False)
    refused(f"model.path={d}", match=r"has no \*.safetensors weights")
    (d / "model.safetensors").write_bytes(b"")
    preflight.check(load_config(None, [f"model.path={d}"]))  # the embedded tokenizer: no tokenizer files needed
    refused(f"model.path={d}", "model.tokenizer=hf", match=r"model.tokenizer=hf but model.path=.* holds none of \['tokenizer.json'")


def test_missing_data_file(tmp_path):
    refused("data.source=gsm8k", f"data.path={tmp_path / 'gsm8k.jsonl'}",
            match=r"data.path \(data.source=gsm8k\): .*gsm8k.jsonl does not exist; give a local .jsonl or .parquet file")
    refused("data.source=math", f"data.path={tmp_path}", match=r"holds no .jsonl or .parquet files")


def launch(tmp_path, *args, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEAN} | {"PYTHON": sys.executable} | env_extra
    start = time.monotonic()
    r = subprocess.run(["bash", str(LAUNCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - start


def test_launcher_refuses_vllm_in_seconds_with_the_message_last(tmp_path):
    r, took = launch(tmp_path, "rollout.engine=vllm", f"run.out_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and took < 30, (took, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("config error: rollout.engine=vllm needs")
    assert "process(es)" not in r.stderr and not (tmp_path / "run").exists()  # torchrun never started


def test_a_rank_refusing_after_torchrun_is_the_launchers_last_line(tmp_path):
    """JETRL_NPROC skips the launcher's question: the trainer refuses, and its line ends the output (after torchrun's
    ChildFailedError report)."""
    r, _ = launch(tmp_path, "parallel.tp=2", f"run.out_dir={tmp_path / 'run'}", JETRL_NPROC="1")
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train_grpo.sh: the run failed with exit code 2 (torchrun: 1): rank 0 failed first (exit code 2): "
                           "config error: this run needs parallel.tp * pp * dp = 2 processes but WORLD_SIZE=1"), last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_more_cuda_ranks_on_a_node_than_gpus(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    refused("parallel.tp=2", match=r"2 processes on this node but 1 visible GPU\(s\): each CUDA rank needs its own")
