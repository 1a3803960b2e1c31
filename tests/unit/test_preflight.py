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
    refused(
        "rollout.engine=vllm",
        match=rf"rollout.engine=vllm needs a CUDA GPU and this run is on the cpu: set rollout.engine=native, "
        rf"or run on a GPU node with vLLM \(pip install vllm=={VLLM_VERSION}\)",
    )


def test_vllm_not_installed_names_the_install_line(gpu, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    refused(
        "rollout.engine=vllm",
        match=rf"vLLM is not installed in this environment: pip install vllm=={VLLM_VERSION}, or set rollout.engine=native",
    )


def test_vllm_of_another_version_is_refused(gpu, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.0")
    refused("rollout.engine=vllm", match=rf"needs vLLM {VLLM_VERSION} .*found 0.33.0: pip install vllm=={VLLM_VERSION}")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: VLLM_VERSION)
    preflight.check_vllm(load_config(None, ["rollout.engine=vllm"]), "cuda")  # the pinned version passes


def test_an_fp8_backend_this_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(
        "precision.backend=triton",
        match=r"precision.backend='triton' is not available on this machine's cpu .*set precision.backend=auto",
    )


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
    refused(
        f"model.path={tmp_path / 'nope'}",
        match=r"model.path='.*nope' does not exist or is not a directory: point it at a local HF model",
    )
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
    refused(
        f"model.path={d}", "model.tokenizer=hf", match=r"model.tokenizer=hf but model.path=.* holds none of \['tokenizer.json'"
    )


def test_missing_data_file(tmp_path):
    refused(
        "data.source=gsm8k",
        f"data.path={tmp_path / 'gsm8k.jsonl'}",
        match=r"data.path \(data.source=gsm8k\): .*gsm8k.jsonl does not exist; give a local .jsonl or .parquet file",
    )
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
    assert last.startswith(
        "train_grpo.sh: the run failed with exit code 2 (torchrun: 1): rank 0 failed first (exit code 2): "
        "config error: this run needs parallel.tp * pp * dp = 2 processes but WORLD_SIZE=1"
    ), last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_more_cuda_ranks_on_a_node_than_gpus(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    refused("parallel.tp=2", match=r"2 processes on this node but 1 visible GPU\(s\): each CUDA rank needs its own")


# ---- memory: an actor whose state alone cannot fit ----------------------------------------------------------

GIB = 2**30


def qwen3_8b(*overrides: str):
    """The Qwen3-8B preset (the layout check runs on any machine)."""
    return load_config([str(REPO / "configs/models/qwen3-8b-base.yaml")], list(overrides))


def test_qwen3_8b_on_one_80gib_gpu_is_refused_with_the_breakdown_and_the_fix():
    cfg = qwen3_8b("parallel.tp=1", "rollout.tp=1", "optim.distributed=true")  # its parameter buffers keep BF16 weights
    parts = preflight.actor_state_bytes(cfg)
    params = parts["gradients"] / 4  # FP32 main_grad: 4 bytes a parameter
    assert 8.19e9 < params < 8.20e9  # Qwen3-8B: 8.19B parameters with its untied lm_head
    assert parts["parameters"] == 2 * params and parts["optimizer"] == 12 * params
    # the reference holds BF16 embeddings, lm_head and norms; its FP8 linears' BF16 weights wait in host memory
    assert parts["reference"] == pytest.approx(2 * (params - 36 * 193e6), rel=0.02)
    # one byte each: the policy's W and W^T and the reference's W of every FP8 linear (the frozen reference makes no W^T)
    assert parts["FP8 weights"] == pytest.approx(2 * 36 * 193e6, rel=0.02)
    assert parts["reference FP8"] == pytest.approx(36 * 193e6, rel=0.02)
    with pytest.raises(
        ConfigError,
        match=r"the actor's state alone needs 159\.0 GiB per GPU \(parameters 15\.3, gradients 30\.5, "
        r"optimizer 91\.5, reference 2\.3, FP8 weights 12\.9, reference FP8 6\.5\) at parallel.tp=1 pp=1 dp=1, more "
        r"than 90% of this GPU's 80\.0 GiB, before any activation: raise parallel.tp or "
        r"parallel.pp, or shard the optimizer state",
    ):
        preflight.check_memory(cfg, 80 * GIB)


@pytest.mark.parametrize(
    "layout,gib",
    [
        ([], 36.5),
        (["parallel.tp=2", "parallel.pp=2", "rollout.tp=2"], 36.5),
        (["parallel.tp=2", "parallel.dp=2", "rollout.tp=2", "grpo.micro_batch_size=8"], 56.6),
        (["parallel.tp=1", "parallel.pp=4", "rollout.tp=1"], 42.3),
        (["parallel.tp=1", "parallel.pp=4", "rollout.tp=1", "parallel.pp_last_layers=6"], 45.7),
        (["optim.distributed=true"], 39.8),
    ],
)
def test_the_four_gpu_layouts_of_qwen3_8b_fit_an_80gib_gpu(layout, gib):
    """The preset (TP 4), TP 2 x PP 2, TP 2 x DP 2 with the optimizer state sharded (the preset's optim.distributed:
    auto), and TP 1 x PP 4, even (the last stage counted: 9 layers and the output layer) or with 6 layers on the last
    stage (the first counted: 10 layers and the embedding). At DP 1 jetrl's FP8 copies take the place of the linears'
    BF16 weights through a step; the distributed optimizer at DP 1 keeps both (3.3 GiB more at TP 4)."""
    cfg = qwen3_8b(*layout)
    assert cfg.parallel.world_size == 4
    preflight.check_memory(cfg, 80 * GIB)
    assert sum(preflight.actor_state_bytes(cfg).values()) / GIB == pytest.approx(gib, abs=0.05)


def test_what_the_estimate_counts_follows_the_settings():
    base = preflight.actor_state_bytes(qwen3_8b("parallel.tp=2", "rollout.tp=2", "optim.distributed=true"))
    lean = preflight.actor_state_bytes(
        qwen3_8b("parallel.tp=2", "rollout.tp=2", "optim.distributed=true", "model.fp8_weight_t=backward", "loss.kl_coef=0")
    )
    assert lean["FP8 weights"] * 2 == base["FP8 weights"] == 2 * base["reference FP8"]  # W alone; base: W and W^T
    assert lean["reference"] == lean["reference FP8"] == 0
    assert preflight.actor_state_bytes(qwen3_8b("precision.mode=bf16"))["FP8 weights"] == 0
    # the mixed-precision optimizer: W and W^T take the place of the linears' BF16 weights through a step
    released = preflight.actor_state_bytes(qwen3_8b("parallel.tp=2", "rollout.tp=2"))  # the preset's auto: not at DP 1
    assert released["FP8 weights"] == 0 and released["parameters"] == base["parameters"]
    sharded = preflight.actor_state_bytes(qwen3_8b("parallel.tp=2", "parallel.dp=2", "rollout.tp=2", "grpo.micro_batch_size=8"))
    assert sharded["optimizer"] * 2 == base["optimizer"] and sharded["parameters"] == base["parameters"]


def test_kv_cache_that_cannot_hold_one_sequence_is_refused_and_a_short_one_said_to_run_in_turns():
    from megatron_jetrl.models.arch import ModelArch
    from megatron_jetrl.rollout.colocated import kv_bytes_per_token, sequences_at_once, turns_note

    arch = ModelArch.from_hf_config(qwen3_8b().model.architecture())
    per_token = kv_bytes_per_token(arch, 1)
    assert per_token == 36 * 2 * 8 * 128 * 2  # K and V, BF16, every layer
    assert sequences_at_once(64 * 1536 * per_token, arch, 64, 1536) == 64  # never more than the engine's share
    assert sequences_at_once(100 * 1536 * per_token, arch, 64, 1536) == 64
    assert turns_note(64 * 1536 * per_token, 64, 64, 1536) is None
    # a sequence's cache is rounded up to whole 256-token slabs: 1500 tokens take 1536
    assert sequences_at_once(10 * 1536 * per_token, arch, 64, 1500) == 10
    assert sequences_at_once(10 * 1536 * per_token - 1, arch, 64, 1500) == 9
    note = turns_note(10 * 1536 * per_token, 64, 10, 1536)
    assert note.startswith(
        "the rollout engine's KV cache (2.11 GiB per rank) holds 10 of the 64 sequences it samples a step "
        "at their full 1536 tokens: the step runs in turns, vLLM preempting the newest sequences once the "
        "cache is full and recomputing them later (counted per step: rollout/preemptions)"
    )
    assert note.endswith("or free the actor's state while the engine is awake: rollout.offload=optimizer")
    with pytest.raises(
        ValueError,
        match=r"cannot hold one sequence of rollout.max_model_len=5120 tokens \(0.70 GiB at "
        r"rollout.tp=1\): raise rollout.kv_cache_gb or rollout.kv_cache_fraction, free the "
        r"actor's state while the engine is awake \(rollout.offload=optimizer\)",
    ):
        sequences_at_once(4096 * per_token, arch, 64, 5120)


@pytest.mark.parametrize(
    "error",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",  # torch's caching allocator (torch.OutOfMemoryError)
        "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163",  # vLLM waking its KV cache (a RuntimeError)
    ],
)
def test_an_out_of_memory_failure_names_what_to_lower(error):
    from megatron_jetrl.rl import faults

    class OutOfMemoryError(RuntimeError):
        pass

    line = faults.report(OutOfMemoryError(error) if "Tried" in error else RuntimeError(error))
    assert error in line
    assert line.endswith(
        "; out of GPU memory: lower grpo.micro_batch_size (activations), rollout.kv_cache_fraction, "
        "rollout.kv_cache_gb or rollout.max_model_len (the engine's KV cache), free the actor's state while the "
        "engine is awake (rollout.offload), or spread the actor wider (parallel.tp, parallel.pp, optim.distributed)"
    )


def test_pinning_the_optimizer_state_needs_host_memory_for_every_rank_of_the_node():
    """rollout.offload=optimizer at Qwen3-8B TP 4: 4 ranks x 24.5 GiB, FP32 main params and moments (22.9) and the
    reference's FP8 bytes (1.6); a node with 64 GiB available is refused with the numbers and the fix, one with 512 GiB
    passes; grads and none pin nothing."""
    cfg = qwen3_8b("rollout.offload=optimizer")
    parts = preflight.actor_state_bytes(cfg)
    assert parts["optimizer"] / 2**30 == pytest.approx(22.9, abs=0.1)
    assert parts["reference FP8"] / 2**30 == pytest.approx(1.6, abs=0.05)
    with pytest.raises(
        ConfigError,
        match=r"rollout.offload=optimizer pins 98.\d GiB of host memory on this node \(4 rank\(s\) "
        r"x 24.5 GiB .*of its 64.0 GiB available: use rollout.offload=grads",
    ):
        preflight.check_host_memory(cfg, 64 << 30, 4)
    preflight.check_host_memory(cfg, 512 << 30, 4)
    preflight.check_host_memory(cfg, 0, 4)  # unknown: not refused
    for what in ("grads", "none"):
        preflight.check_host_memory(qwen3_8b(f"rollout.offload={what}"), 1 << 30, 4)
    assert preflight.host_available_bytes() >= 0
