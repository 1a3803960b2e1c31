"""The compiled-kernel caches (rl/jit_cache.py): one directory for the trainer's and the engines' DeepGEMM kernels and
Triton's, progress lines while kernels are compiled, and the warm command's refusal to pretend on the CPU."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jetrl.rl.config import load_config
from megatron_jetrl.rl.jit_cache import CompileProgress, cache_dirs, count_kernels, pin_cache_dirs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_directory_holds_both_caches(clean_env, tmp_path):
    assert cache_dirs(str(tmp_path / "jit")) == {
        "deep_gemm": tmp_path / "jit" / "deep_gemm",
        "triton": tmp_path / "jit" / "triton",
    }
    pinned = pin_cache_dirs(str(tmp_path / "jit"))
    assert os.environ["DG_JIT_CACHE_DIR"] == str(tmp_path / "jit" / "deep_gemm") == str(pinned["deep_gemm"])
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "jit" / "triton")


def test_without_a_directory_the_trainer_shares_vllms_default(clean_env, tmp_path):
    """vLLM 0.26 (vllm/utils/deep_gemm.py) sets DG_JIT_CACHE_DIR to $VLLM_CACHE_ROOT/deep_gemm when it is unset; the
    trainer's DeepGEMM would otherwise compile into ~/.deep_gemm, a second copy of the same kernels."""
    assert cache_dirs("") == {"deep_gemm": Path("~/.cache/vllm/deep_gemm").expanduser(), "triton": None}
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dirs("")["deep_gemm"] == tmp_path / "xdg" / "vllm" / "deep_gemm"
    clean_env.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    assert cache_dirs("")["deep_gemm"] == tmp_path / "vllm" / "deep_gemm"
    clean_env.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "dg"))
    clean_env.setenv("TRITON_CACHE_DIR", str(tmp_path / "tr"))
    assert cache_dirs("") == {"deep_gemm": tmp_path / "dg", "triton": tmp_path / "tr"}
    pin_cache_dirs("")
    assert os.environ["DG_JIT_CACHE_DIR"] == str(tmp_path / "dg") and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "tr")


def test_progress_counts_new_kernels_and_speaks_only_when_some_were_added(tmp_path):
    dirs = cache_dirs(str(tmp_path))
    (dirs["deep_gemm"] / "cache" / "kernel.fp8_gemm.0").mkdir(parents=True)  # one from an earlier run
    (dirs["deep_gemm"] / "tmp").mkdir()  # DeepGEMM's scratch: not a kernel
    assert count_kernels(dirs) == 1
    out = io.StringIO()
    progress = CompileProgress(dirs, interval=3600, out=out)
    progress.report()
    assert out.getvalue() == ""  # nothing compiled yet: silent
    for i in range(3):
        (dirs["deep_gemm"] / "cache" / f"kernel.fp8_gemm.{i + 1}").mkdir()
    (dirs["triton"] / "abc123").mkdir(parents=True)
    progress.report()
    line = out.getvalue()
    assert line.startswith("compiling GPU kernels (first use of these shapes): 4 new in ") and f"cached in {tmp_path};" in line
    assert "`megatron_jetrl.rl.warm_cache` compiles" in line
    progress.report()
    assert out.getvalue() == line  # no new kernels, no new line


def test_progress_thread_stops(tmp_path):
    progress = CompileProgress(cache_dirs(str(tmp_path)), interval=0.01, out=io.StringIO())
    progress.start()
    progress.stop()
    progress.join(timeout=5)
    assert not progress.is_alive()


def test_the_cache_directory_may_change_on_resume():
    from megatron_jetrl.rl.run_state import APPLIED_ON_RESUME

    assert "run.jit_cache_dir" in APPLIED_ON_RESUME
    assert load_config(None, ["run.jit_cache_dir=/shared/jit"]).run.jit_cache_dir == "/shared/jit"


def test_the_warm_command_on_the_cpu_says_there_is_nothing_to_compile():
    done = subprocess.run(
        [sys.executable, "-m", "megatron_jetrl.rl.warm_cache", "configs/tiny.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "runs on the CPU, where nothing is JIT-compiled: nothing to warm" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_jetrl.rl.warm_cache", "configs/tiny.yaml", "run.stepz=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "did you mean 'steps'" in bad.stderr


def test_the_launcher_can_ask_the_warm_command_for_the_world_size():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_jetrl.rl.warm_cache",
            "configs/tiny.yaml",
            "parallel.tp=2",
            "--get",
            "parallel.world_size",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "2"


# ---- rl/warm_gemms.py: which GEMMs are compiled ahead ---------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_jetrl.rl import warm_gemms  # noqa: E402
from megatron_jetrl.rl.config import split_args  # noqa: E402

E2E = [str(REPO / "configs/models/qwen3-8b-base.yaml"), str(REPO / "configs/e2e_8b.yaml")]


@given(max_m=st.integers(1, 40000), n=st.integers(1, 30000), sms=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_m_values_hold_every_boundary_of_the_heuristic(max_m, n, sms):
    ms = warm_gemms.m_values(max_m, n, sms)
    assert ms == sorted(set(ms)) and all(1 <= m <= max_m for m in ms)
    assert {m for m in (1, 2, 4, 8, 16, 64) if m <= max_m} <= set(ms)
    assert set(range(64, max_m + 1, 64)) <= set(ms)  # every block_m boundary
    for block_n in (16, 128, 256):
        if block_n <= n:
            waves = {w * sms * 128 // -(-n // block_n) for w in range(1, 11)}
            assert {m for m in waves if 1 <= m <= max_m} <= set(ms)


def gpu_config(monkeypatch, *overrides):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a config for a GPU run, resolved on this CPU box
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    return load_config(*split_args([*E2E, *overrides]))


PP1 = ["parallel.pp=1", "parallel.pp_last_layers=0"]  # e2e_8b's own layout is TP 1 x PP 4 (split 10 + 10 + 10 + 6)


@pytest.mark.parametrize(
    "layout, train_tp, rollout_tp",
    [
        ([], 1, 1),
        ([*PP1, "parallel.tp=4", "rollout.tp=4"], 4, 4),
        (["parallel.tp=2", "parallel.pp=2", "parallel.pp_last_layers=0", "rollout.tp=2"], 2, 2),
        ([*PP1, "parallel.tp=4", "rollout.engine=native", "rollout.tp=1"], 4, 1),
    ],
)
def test_every_fp8_linear_of_both_sides_is_covered_once(monkeypatch, layout, train_tp, rollout_tp):
    cfg = gpu_config(monkeypatch, "precision.mode=jetrl", *layout)
    items = warm_gemms.work_items(cfg, num_sms=132, procs=48)
    arch = cfg.arch()
    max_len = cfg.rollout.max_model_len or min(arch.max_position_embeddings, 1024 + cfg.rollout.max_new_tokens)
    train_m, logprob_m = cfg.grpo.micro_batch_size * max_len, cfg.grpo.logprob_batch * max_len
    assert logprob_m == 2 * train_m  # the e2e config scores rollouts in passes 2x the training micro-batch
    for tp in {train_tp, rollout_tp}:
        for _, n, k in warm_gemms.linear_shapes(arch, tp):
            fwd = sorted(m for it in items if it[:2] == (n, k) and it[3] == "fprop" for m in it[2])
            bwd = sorted(m for it in items if it[:2] == (n, k) and it[3] == "train" for m in it[2])
            assert len(fwd) == len(set(fwd)) and len(bwd) == len(set(bwd))  # no M twice
            assert set(fwd) | set(bwd) >= set(warm_gemms.m_values(max(warm_gemms.PREFILL_TOKENS, logprob_m), n, 132))
            if tp == train_tp:  # the trainer's backward: DGrad's output is K wide, so K's boundaries too
                assert set(bwd) >= {m for m in warm_gemms.m_values(train_m, k, 132) if m >= 128}
            elif (n, k) not in {(n2, k2) for _, n2, k2 in warm_gemms.linear_shapes(arch, train_tp)}:
                assert not bwd  # the engine's own shapes: forward only
    assert 40 <= len(items) <= 60  # pieces for 48 processes


def test_the_backward_is_warmed_up_to_the_padded_micro_batch(monkeypatch):
    """train_step lengthens a micro-batch's rows to whole 128-token blocks (4 rows of 1030 tokens train as 4 x 1056):
    the backward's largest M is the padded one."""
    from megatron_jetrl.fp8.gemm import token_multiple

    cfg = gpu_config(monkeypatch, "precision.mode=jetrl", "rollout.max_model_len=1030", "grpo.micro_batch_size=4")
    items = warm_gemms.work_items(cfg, num_sms=132, procs=8)
    assert token_multiple(4) == 32
    bwd = {m for it in items if it[3] == "train" for m in it[2]}
    assert max(bwd) == 4 * 1056 and 4 * 1056 in warm_gemms.m_values(4 * 1056, 4096, 132)


def test_shapes_per_rank_are_the_fused_linears_split_by_tp(monkeypatch):
    arch = gpu_config(monkeypatch).arch()
    assert warm_gemms.linear_shapes(arch, 4) == [
        ("linear_qkv", 1536, 4096),
        ("linear_proj", 4096, 1024),
        ("linear_fc1", 6144, 4096),
        ("linear_fc2", 4096, 3072),
    ]


def test_bf16_compiles_nothing_and_the_foil_only_the_engines_forward(monkeypatch):
    assert warm_gemms.work_items(gpu_config(monkeypatch, "precision.mode=bf16"), 132, 8) == []
    foil = warm_gemms.work_items(gpu_config(monkeypatch, "precision.mode=bf16-train-fp8-rollout"), 132, 8)
    assert foil and {kind for *_, kind in foil} == {"fprop"}


@pytest.mark.parametrize("tp", [1, 2])
def test_exact_logprobs_adds_both_sides_lm_head_gemm(monkeypatch, tp):
    """The trainer's lm_head shard (vocabulary padded to 128 x TP) and the engine's (padded to 64, then split) differ
    at TP 2 (Qwen3's 151936 tokens: 76032 against 75968 columns): both are warmed, at K = hidden."""
    cfg = gpu_config(
        monkeypatch,
        "precision.mode=jetrl",
        f"parallel.tp={tp}",
        f"rollout.tp={tp}",
        "parallel.dp=1",
        "precision.exact_logprobs=true",
    )
    heads = {(n, k) for n, k, _, kind in warm_gemms.work_items(cfg, 132, 48) if kind == "lm_head"}
    assert heads == ({(151936, 4096)} if tp == 1 else {(76032, 4096), (75968, 4096)})
    off = gpu_config(monkeypatch, "precision.mode=jetrl", "precision.exact_logprobs=false")
    assert not any(kind == "lm_head" for *_, kind in warm_gemms.work_items(off, 132, 48))


def test_warm_gemms_on_a_cpu_box_says_nothing_is_compiled():
    done = subprocess.run(
        [sys.executable, "-m", "megatron_jetrl.rl.warm_gemms", *E2E], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "no CUDA GPU here: nothing is JIT-compiled" in done.stdout, done.stderr
