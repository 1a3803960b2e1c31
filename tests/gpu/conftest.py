"""Fixtures shared by the GPU tests (plain helpers: gpu_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch


def one_rank_tp1() -> None:
    """Megatron's parallel state at TP1 on a one-rank process group (MASTER_PORT 29533 unless set: a child process may
    set its own); a second call finds it made."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(k, v)
    from megatron_jetrl.actor.parallel import init_parallel

    init_parallel(tp=1, pp=1, seed=1234)


@pytest.fixture(scope="module")
def parallel():
    """`one_rank_tp1` for a test module of one-GPU actor tests."""
    one_rank_tp1()
    return True


@pytest.fixture(scope="module")
def te_ready():
    """CUDA + Transformer Engine importable, megatron's parallel state at TP1 on a one-rank process group (skips
    otherwise)."""
    from megatron_jetrl.fp8 import te as te_mod

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not te_mod.te_installed():
        pytest.skip(te_mod.INSTALL_HINT)
    one_rank_tp1()
    import transformer_engine.pytorch  # noqa: F401  (fails loudly here if the kit is broken)

    return True
