"""Save / resume the actor in the `models.shards` layout (one safetensors file per TP x PP rank + meta.json).

DP rank 0 of every (TP, PP) position writes its parameters (local megatron names, as trained); after a
barrier global rank 0 seals the directory with `write_meta`. The optimizer state goes next to each shard as
`optim_tpXX_ppYYY.pt` when an optimizer is given, its sha256 in meta.json (`optimizer`), checked before the file
is unpickled. A replicated optimizer's state is the same on every DP rank: DP rank 0 writes its `state_dict()`.
A distributed optimizer (`OptimConfig.distributed`) holds 1/DP of it per rank: the shards are first gathered on
DP rank 0 in megatron's `dp_zero` format (`get_parameter_state_dp_zero`, independent of the DP size) and written
with the `state_dict()` as `{"distributed": True, "state_dict": ..., "parameter_state": [...]}`; on load
DP rank 0 scatters them back (`load_parameter_state_from_dp_zero`), so a resume may change the DP size.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_jetrl.actor.fp8_layers import unwrap
from megatron_jetrl.actor.gpt import pp_last_layers
from megatron_jetrl.actor.train_step import adam_is_fused, use_fused_adam
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models.shards import (
    CheckpointError,
    ShardedCheckpoint,
    file_entry,
    save_rank_shard,
    shard_name,
    write_meta,
    writing,
)


def _ranks():
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )


def optimizer_file(tp_rank: int, pp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def _sharded(optimizer) -> list:
    """The sub-optimizers of megatron's (chained) optimizer that are DistributedOptimizers (ZeRO-1 shards)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(o, "get_parameter_state_dp_zero")]


def _optimizer_state(optimizer):
    """Collective over DP when the optimizer is distributed: what DP rank 0 writes (None on other DP ranks)."""
    sharded = _sharded(optimizer)
    if not sharded:
        return optimizer.state_dict()
    if not any(o.optimizer.state for o in sharded):  # never stepped (megatron cannot export that): a fresh one
        return {"distributed": True, "state_dict": None, "parameter_state": None}
    gathered = [o.get_parameter_state_dp_zero() for o in sharded]  # on DP rank 0; None elsewhere
    return {"distributed": True, "state_dict": optimizer.state_dict(), "parameter_state": gathered}


def _load_optimizer_state(optimizer, state, where: str) -> None:
    sharded = _sharded(optimizer)
    saved_distributed = isinstance(state, dict) and state.get("distributed") is True
    if bool(sharded) != saved_distributed:
        raise CheckpointError(
            f"{where} holds the state of a {'distributed' if saved_distributed else 'replicated'} optimizer and this run's is "
            f"{'distributed' if sharded else 'replicated'}: resume with optim.distributed={str(saved_distributed).lower()}"
        )
    fused = adam_is_fused(optimizer)  # this run's choice (OptimConfig.fused): the state loaded brings the saver's
    if not sharded:
        optimizer.load_state_dict(state)
        use_fused_adam(optimizer, fused)
        return
    if state["state_dict"] is None:  # saved before its first step: this run's fresh optimizer is that state
        return
    from megatron.core import parallel_state as ps

    optimizer.load_state_dict(state["state_dict"])  # param groups; torch Adam's per-param "step" set from them
    dp_zero = ps.get_data_parallel_rank() == 0
    # Two megatron-core 0.16.1 faults with torch's Adam (no apex/TE), the optimizer on CPU and on GPUs without TE:
    # (1) the scatter copies every key of the per-param state from the dp_zero tensors, which hold only param /
    #     exp_avg / exp_avg_sq, so "step" is a KeyError: it is held out meanwhile (load_state_dict set it);
    # (2) load_state_dict gives every param the *same* step tensor, which torch's Adam then increments once per
    #     param in place (wrong bias correction from the first step on): each param gets its own copy back.
    steps = [(st, st.pop("step")) for o in sharded for st in o.optimizer.state.values() if "step" in st]
    try:
        with torch.no_grad():  # FP32 params are their own main params: the shards copied into are views of leaves
            for o, parameter_state in zip(sharded, state["parameter_state"], strict=True):
                o.load_parameter_state_from_dp_zero(parameter_state if dp_zero else None)  # scatter from DP rank 0
    finally:
        for st, step in steps:
            st["step"] = step.clone()
    use_fused_adam(optimizer, fused)


def save_checkpoint(
    model, directory: str | Path, *, hf_config: dict, flow: PrecisionFlow, iteration: int, spec: str = "local", optimizer=None
) -> None:
    """Collective: every rank calls it. `hf_config`: the model's config.json dict; `spec`: mapping naming."""
    tp_rank, tp, pp_rank, pp, dp_rank = _ranks()
    optimizer_state = _optimizer_state(optimizer) if optimizer is not None else None
    written = None
    if dp_rank == 0:
        state = {name: p for name, p in unwrap(model).named_parameters()}
        written = {"shard": save_rank_shard(directory, state, tp_rank, pp_rank)}
        if optimizer is not None:
            path = Path(directory) / optimizer_file(tp_rank, pp_rank)
            with writing(path), open(path, "wb") as f:  # a Python file: a full disk is ENOSPC, not "unexpected pos"
                torch.save(optimizer_state, f)
            written["optimizer"] = file_entry(path)
    manifests = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, written)  # also the barrier: every file is on disk after this
    if dist.get_rank() == 0:
        manifests = [m for m in manifests if m is not None]
        last = pp_last_layers(model)
        write_meta(
            directory,
            iteration=iteration,
            tp=tp,
            pp=pp,
            spec=spec,
            hf_config=hf_config,
            flow=flow.to_dict(),
            shards=[m["shard"] for m in manifests],
            extra={
                "optimizer": [m["optimizer"] for m in manifests] if optimizer is not None else False,
                **({"pp_last_layers": last} if last else {}),
            },
        )
    dist.barrier()


def load_checkpoint(model, directory: str | Path, *, optimizer=None, verify: bool = False) -> dict:
    """Load this rank's shard (and optimizer state) saved at the same TP x PP; returns meta.json's dict."""
    tp_rank, tp, pp_rank, pp, _ = _ranks()
    ckpt = ShardedCheckpoint.open(directory, verify=verify)
    if (ckpt.tp, ckpt.pp) != (tp, pp):
        raise CheckpointError(
            f"{directory} was saved at TP={ckpt.tp} x PP={ckpt.pp}; this run is TP={tp} x PP={pp} (reshard with the converter)"
        )
    if ckpt.meta.get("pp_last_layers", 0) != pp_last_layers(model):
        raise CheckpointError(
            f"{directory} was saved with parallel.pp_last_layers={ckpt.meta.get('pp_last_layers', 0)}; this "
            f"run has {pp_last_layers(model)}: resume with the split it was saved with (0: even)"
        )
    params = dict(unwrap(model).named_parameters())
    with safe_open(Path(directory) / shard_name(tp_rank, pp_rank), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        if names != set(params):
            raise CheckpointError(
                f"shard {shard_name(tp_rank, pp_rank)} holds {sorted(names ^ set(params))} not matching the model"
            )
        for name, p in params.items():
            p.copy_(f.get_tensor(name))
    if optimizer is not None:
        files = ckpt.meta.get("optimizer")
        if not files:
            raise CheckpointError(f"{directory} has no optimizer state")
        name = optimizer_file(tp_rank, pp_rank)
        entry = next((e for e in files if e["file"] == name), None) if isinstance(files, list) else None
        if entry is None:
            raise CheckpointError(
                f"{directory}/meta.json has no sha256 of {name} (a damaged meta.json, or a checkpoint "
                "written before optimizer files were hashed): resume from another checkpoint"
            )
        path = ckpt.check_file(entry, verify=verify, what="optimizer state")  # before unpickling it
        _load_optimizer_state(optimizer, torch.load(path, weights_only=False), f"{directory}/{name}")
    return ckpt.meta
