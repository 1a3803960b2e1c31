"""What a new user types first: --help, an --option instead of an override, a GPU script on a CPU box; and the
layout the next engineer reads (no import circle between the trainer and the fault watch)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_jetrl.rl import config, train

REPO = Path(__file__).resolve().parents[2]


def test_train_help_is_real_help(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "[CONFIG.yaml ...] [section.key=value ...]" in out and "run.steps=10" in out and "--print" in out


@pytest.mark.parametrize("args", [["--steps", "10"], ["configs/tiny.yaml", "--steps=10"]])
def test_an_option_gets_the_override_it_means(args, capsys):
    assert train.main(args) == 2
    assert (
        "is not an option: settings are section.key=value overrides after the config files, e.g. run.steps=10 or "
        "warmup.steps=10" in capsys.readouterr().err
    )
    assert config.main([*args, "--get", "parallel.world_size"]) == 2
    assert "e.g. run.steps=10" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warnings are kept on GPU machines")
def test_no_apex_or_te_warnings_on_cpu():
    r = subprocess.run(
        [sys.executable, "-c", "import megatron_jetrl.rl.train, megatron_jetrl.actor.provider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "not installed" not in r.stderr and "deprecated" not in r.stderr, r.stderr


@pytest.mark.parametrize("python", ["no torch", "no gpu"])
def test_run_gpu_tests_says_it_needs_a_gpu(tmp_path, python):
    """With a python3 that lacks torch (`-S`: no site-packages) or has it without CUDA: the script's own message."""
    if python == "no gpu" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {"-S" if python == "no torch" else ""} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(REPO / "tools/gpu/run_gpu_tests.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "No module named" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("tools/gpu/run_gpu_tests.sh needs a CUDA GPU"), r.stderr


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return names


def test_the_fault_watch_does_not_import_the_trainer_and_the_package_has_no_fault_injection():
    rl = REPO / "megatron_jetrl" / "rl"
    watch = imports(rl / "faults.py")
    assert not {n for n in watch if "rl.train" in n or "rl.step" in n}, watch
    package = list((REPO / "megatron_jetrl").rglob("*.py"))
    assert not [p for p in package if "fault_injection" in p.name or any("fault_injection" in n for n in imports(p))]
    assert len((rl / "faults.py").read_text().splitlines()) < 300


def test_batch_invariant_ops_are_named_so():
    assert not (REPO / "megatron_jetrl/models/ops.py").exists()
    from megatron_jetrl.models import batch_invariant_ops

    assert callable(batch_invariant_ops.tree_sum)


def test_phase_times_include_the_device_work_queued_in_the_phase(monkeypatch):
    """`Phases` ends each phase with a device sync (once CUDA is in use), so queued GPU work is billed to the phase
    that issued it; on a CPU run it only times."""
    import torch

    from megatron_jetrl.rollout.sync import Phases

    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1))
    t = Phases()
    with t("eval"):
        pass
    with t("eval"):
        pass
    assert list(t) == ["time/eval"] and t["time/eval"] >= 0 and synced == [1, 1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with t("update"):
        pass
    assert synced == [1, 1] and "time/update" in t


@pytest.fixture
def one_rank():
    from gloo import one_gloo_rank

    yield from one_gloo_rank()


def test_the_loops_phases_keep_each_phases_memory_peak_and_the_step_reports_the_most_on_any_rank(monkeypatch, one_rank):
    """`Phases(memory=True)` resets torch's peak counters as each phase starts and keeps the most allocated and reserved
    bytes over its repeats; `memory_metrics` reports them in GiB (the max over ranks: one gloo rank here) with the step's
    most reserved, and the allocator's device-synchronizing events (retries after freeing the cache, cudaFree calls)
    counted per phase over its repeats; a CPU run has none."""
    import torch

    from megatron_jetrl.rl.step import Phases, memory_metrics

    allocated, reserved, resets = iter([3 << 30, 5 << 30, 2 << 30]), iter([6 << 30, 7 << 30, 8 << 30]), []
    counters = iter([(0, 10), (1, 13), (1, 13), (1, 14), (1, 14), (4, 40)])  # (retries, frees) at each phase's start and end
    monkeypatch.setattr(
        torch.cuda, "memory_stats", lambda: dict(zip(("num_alloc_retries", "num_device_free"), next(counters)), num_ooms=0)
    )
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: next(reserved))
    t = Phases(memory=True)
    for name in ("eval", "eval", "update"):
        with t(name):
            pass
    assert resets == [1, 1, 1] and t.peaks == {"eval": (5 << 30, 7 << 30), "update": (2 << 30, 8 << 30)}
    assert t.stalls == {"eval": (1, 4), "update": (3, 26)}
    assert memory_metrics(t) == {
        "memory/eval_gib": 5.0,
        "memory/update_gib": 2.0,
        "memory/reserved_gib": 8.0,
        "memory/eval_alloc_retries": 1,
        "memory/eval_cuda_frees": 4,
        "memory/update_alloc_retries": 3,
        "memory/update_cuda_frees": 26,
    }
    assert list(t) == ["time/eval", "time/update"]  # the step's time sums only times
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cpu = Phases(memory=True)
    with cpu("eval"):
        pass
    assert cpu.peaks == {} and memory_metrics(cpu) == {}
    nested = Phases("sync/", "_s")  # a sync's parts leave the loop's counters alone
    assert not nested.memory


def test_a_sleeping_engines_unmapped_bytes_leave_the_phases_peaks(monkeypatch):
    """vLLM's sleep unmaps its memory but torch still counts the blocks: a phase the engine sleeps through (eval,
    update) reports torch's peaks less the engine's unmapped bytes; a phase in which it wakes or falls asleep (sync,
    rollout) keeps them, since its peak is the engine awake."""
    import torch

    from megatron_jetrl.rollout.sync import Phases

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 90 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 95 << 30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    asleep = [20 << 30]
    t = Phases(memory=True, unmapped=lambda: asleep[0])
    with t("update"):  # asleep throughout
        pass
    with t("sync"):  # wakes
        asleep[0] = 0
    with t("rollout"):  # falls asleep at its end
        asleep[0] = 20 << 30
    assert t.peaks == {"update": (70 << 30, 75 << 30), "sync": (90 << 30, 95 << 30), "rollout": (90 << 30, 95 << 30)}
