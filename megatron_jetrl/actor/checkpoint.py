"""Save / resume the actor in the `models.shards` layout (one safetensors file per TP x PP rank + meta.json).

DP rank 0 of every (TP, PP) position writes its parameters (local megatron names, as trained); after a
barrier global rank 0 seals the directory with `write_meta`. The optimizer state (identical on DP ranks:
no distributed optimizer) goes next to each shard as `optim_tpXX_ppYYY.pt` when an optimizer is given, its sha256
in meta.json (`optimizer`), checked before the file is unpickled.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_jetrl.actor.fp8_layers import unwrap
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models.shards import (CheckpointError, ShardedCheckpoint, file_entry, save_rank_shard, shard_name, write_meta,
                                          writing)


def _ranks():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_rank())


def optimizer_file(tp_rank: int, pp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def save_checkpoint(model, directory: str | Path, *, hf_config: dict, flow: PrecisionFlow, iteration: int,
                    spec: str = "local", optimizer=None) -> None:
    """Collective: every rank calls it. `hf_config`: the model's config.json dict; `spec`: mapping naming."""
    tp_rank, tp, pp_rank, pp, dp_rank = _ranks()
    written = None
    if dp_rank == 0:
        state = {name: p for name, p in unwrap(model).named_parameters()}
        written = {"shard": save_rank_shard(directory, state, tp_rank, pp_rank)}
        if optimizer is not None:
            path = Path(directory) / optimizer_file(tp_rank, pp_rank)
            with writing(path), open(path, "wb") as f:  # a Python file: a full disk is ENOSPC, not "unexpected pos"
                torch.save(optimizer.state_dict(), f)
            written["optimizer"] = file_entry(path)
    manifests = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, written)  # also the barrier: every file is on disk after this
    if dist.get_rank() == 0:
        manifests = [m for m in manifests if m is not None]
        write_meta(directory, iteration=iteration, tp=tp, pp=pp, spec=spec, hf_config=hf_config, flow=flow.to_dict(),
                   shards=[m["shard"] for m in manifests],
                   extra={"optimizer": [m["optimizer"] for m in manifests] if optimizer is not None else False})
    dist.barrier()


def load_checkpoint(model, directory: str | Path, *, optimizer=None, verify: bool = False) -> dict:
    """Load this rank's shard (and optimizer state) saved at the same TP x PP; returns meta.json's dict."""
    tp_rank, tp, pp_rank, pp, _ = _ranks()
    ckpt = ShardedCheckpoint.open(directory, verify=verify)
    if (ckpt.tp, ckpt.pp) != (tp, pp):
        raise CheckpointError(f"{directory} was saved at TP={ckpt.tp} x PP={ckpt.pp}; this run is TP={tp} x PP={pp} (reshard with the converter)")
    params = dict(unwrap(model).named_parameters())
    with safe_open(Path(directory) / shard_name(tp_rank, pp_rank), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        if names != set(params):
            raise CheckpointError(f"shard {shard_name(tp_rank, pp_rank)} holds {sorted(names ^ set(params))} not matching the model")
        for name, p in params.items():
            p.copy_(f.get_tensor(name))
    if optimizer is not None:
        files = ckpt.meta.get("optimizer")
        if not files:
            raise CheckpointError(f"{directory} has no optimizer state")
        name = optimizer_file(tp_rank, pp_rank)
        entry = next((e for e in files if e["file"] == name), None) if isinstance(files, list) else None
        if entry is None:
            raise CheckpointError(f"{directory}/meta.json has no sha256 of {name} (a damaged meta.json, or a checkpoint "
                                  "written before optimizer files were hashed): resume from another checkpoint")
        path = ckpt.check_file(entry, verify=verify, what="optimizer state")  # before unpickling it
        optimizer.load_state_dict(torch.load(path, weights_only=False))
    return ckpt.meta
