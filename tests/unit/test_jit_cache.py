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
    assert cache_dirs(str(tmp_path / "jit")) == {"deep_gemm": tmp_path / "jit" / "deep_gemm", "triton": tmp_path / "jit" / "triton"}
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
    done = subprocess.run([sys.executable, "-m", "megatron_jetrl.rl.warm_cache", "configs/tiny.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "runs on the CPU, where nothing is JIT-compiled: nothing to warm" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_jetrl.rl.warm_cache", "configs/tiny.yaml", "run.stepz=1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean 'steps'" in bad.stderr


def test_the_launcher_can_ask_the_warm_command_for_the_world_size():
    done = subprocess.run([sys.executable, "-m", "megatron_jetrl.rl.warm_cache", "configs/tiny.yaml", "parallel.tp=2",
                           "--get", "parallel.world_size"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "2"
