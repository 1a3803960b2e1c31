"""Model-parallel setup for the megatron-core actor.

``init_parallel(tp, pp)`` brings up torch.distributed from the torchrun environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) unless a default process
group already exists, applies the megatron-core CPU patch when there is no GPU
(``patches/megatron_core_0_16_1_cpu.py``), initializes megatron's parallel state and seeds
megatron's RNG streams. ``destroy_parallel()`` undoes the megatron part (and the process group
if ``init_parallel`` created it).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_OWNS_PROCESS_GROUP = False


def apply_cpu_patch_if_needed() -> bool:
    """Apply the megatron-core CPU patch when CUDA is unavailable. Returns True if applied."""
    if torch.cuda.is_available():
        return False
    from megatron_jetrl.patching import load_patch

    return load_patch("megatron_core_0_16_1_cpu").apply()


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    backend: str | None = None,
    seed: int = 1234,
    timeout_minutes: int = 10,
) -> None:
    """Initialize torch.distributed (if needed) and megatron-core model parallelism.

    Args:
        tp: tensor-model-parallel size.
        pp: pipeline-model-parallel size. Data-parallel size is ``world_size // (tp * pp)``.
        backend: process-group backend when this call creates the group; default ``nccl`` with a
            GPU, ``gloo`` without. Ignored when a default process group already exists.
        seed: base seed for ``model_parallel_cuda_manual_seed`` (megatron derives the per-TP-rank
            and expert streams from it).
        timeout_minutes: process-group timeout when this call creates the group.
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    has_cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_parallel: torch.distributed is not initialized and the torchrun environment "
                f"is incomplete (missing {missing}); launch with torchrun or initialize the "
                f"process group first"
            )
        if backend is None:
            backend = "nccl" if has_cuda else "gloo"
        if has_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
        _OWNS_PROCESS_GROUP = True

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")

    apply_cpu_patch_if_needed()

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(  # megatron's TP/PP/DP groups get the same timeout (default 30 min)
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, distributed_timeout_minutes=timeout_minutes
    )

    from megatron.core import tensor_parallel

    # With the CPU patch applied this name is the patched CPU-generator version.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron parallel state; destroy the process group if init_parallel made it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False


def group_device(group) -> torch.device:
    """Where a collective over `group` takes its tensors: this rank's GPU under NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def from_last_stage(value):
    """`value` as the last stage of this rank's pipeline holds it, on every stage of it (itself at PP 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group, device=group_device(group))
    return box[0]
