"""One-process gloo helpers shared by tests/unit and tests/e2e (tests/ is on sys.path via tests/conftest.py)."""

from __future__ import annotations

import os
import socket

ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_gloo_rank():
    """A module fixture's body: this test process as the only rank (TP1, PP1) of a gloo group; everything
    (process group, megatron state, the CPU patch, the torchrun variables) undone after."""
    import torch.distributed as dist

    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel

    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    init_parallel(tp=1, pp=1)
    yield
    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    from patches import megatron_core_0_16_1_cpu as patch

    patch.revert()  # leave the process as test_megatron_cpu.py expects it
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
