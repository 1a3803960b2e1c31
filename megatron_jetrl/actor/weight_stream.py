"""The live actor's HF `(name, tensor)` stream: the source of the weight sync after every optimizer step.

Each linear's TP shards -- FP8 bytes (`fp8_layers.fp8_weights`, the very `QuantizedWeight`s the forward
used; for the TE spec `te_recipe.te_fp8_weights`, TE's own kernel's bytes and scale_inv), their scale grids, or BF16
params -- are all-gathered over the TP group (FP8 as a `uint8` view: gloo
refuses float8) and handed to `models.export.hf_tensors`, the one stream the converter writes from too.
`to="rank0"`: only global rank 0 (where native engines live) receives pairs, the other ranks of data-parallel
replica 0 take part in the gathers. `to="all"`: every rank receives the whole model (each replica's TP group
gathers its own copy), for colocated engines on every rank. Under pipeline parallelism each stage converts its own
layers (`models.model_entries` of that stage) and broadcasts them over its pipeline group, stage after stage, so every
rank sees the PP 1 stream: the same names, order and bytes. Every rank must run `actor_weight_stream` to the end (the
gathers are collectives, in the mapping table's order); `drain()` does that where nothing is consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_jetrl.actor.fp8_layers import fp8_weights, unwrap
from megatron_jetrl.actor.gpt import model_spec, stage_entries
from megatron_jetrl.actor.parallel import group_device
from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight
from megatron_jetrl.fp8.quant import wire_bytes
from megatron_jetrl.models import ModelArch, hf_tensors
from megatron_jetrl.models.export import stream_layout


def _tp_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """This tensor on every TP rank, in rank order (FP8 travels as its bytes)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return [tensor]
    wire = wire_bytes(tensor.detach().contiguous())
    parts = [torch.empty_like(wire) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, wire, group=ps.get_tensor_model_parallel_group())
    return [p.view(tensor.dtype) for p in parts]


def actor_weight_stream(model, arch: ModelArch, flow: PrecisionFlow, to: str = "rank0") -> Iterator[tuple[str, torch.Tensor]]:
    """HF pairs of the actor's current weights on global rank 0 (`to="rank0"`) or on every rank (`to="all"`);
    collective, see above."""
    from megatron.core import parallel_state as ps

    if to not in ("rank0", "all"):
        raise ValueError(f"to must be 'rank0' or 'all', got {to!r}")
    if to == "rank0" and ps.get_data_parallel_rank() != 0:
        return
    params = dict(unwrap(model).named_parameters()) | dict(unwrap(model).named_buffers())  # (buffers: the KV scales)
    spec = model_spec(model)
    quantized = {}
    if flow.train_fp8:
        if spec == "te":
            from megatron_jetrl.actor.te_recipe import te_fp8_weights

            quantized = te_fp8_weights(model, flow)
        else:
            quantized = fp8_weights(model)

    def fetch(name: str) -> list[torch.Tensor]:
        return _tp_gather(params[name].detach())

    def fetch_fp8(name: str) -> list[QuantizedWeight]:
        if name not in quantized:  # BF16 training: quantize the shards as the trainer's FP8 forward would
            return [QuantizedWeight.quantize(t, flow) for t in fetch(name)]
        w = quantized[name]
        return [QuantizedWeight(q, s) for q, s in zip(_tp_gather(w.q), _tp_gather(w.s))]

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    kv = flow.trainer_kv_scales
    mine = hf_tensors(arch, flow, stage_entries(model, arch, kv_scales=kv), fetch, fetch_fp8)
    pairs = (
        mine
        if pp == 1
        else _across_stages(
            mine,
            stage,
            pp,
            [stream_layout(arch, flow, stage_entries(model, arch, pp_rank=source, kv_scales=kv)) for source in range(pp)],
        )
    )
    if to == "all" or dist.get_rank() == 0:
        yield from pairs
    else:
        drain(pairs)


def _across_stages(
    mine: Iterator[tuple[str, torch.Tensor]], stage: int, pp: int, layouts: list[list[tuple[str, tuple[int, ...], torch.dtype]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's pairs on every rank of this pipeline group, stage by stage: the PP 1 stream's order (embedding,
    layers, final norm, lm_head). Each rank knows every stage's names, shapes and dtypes from the mapping table
    (`layouts`, per stage), so only bytes travel: one broadcast per tensor from the stage that holds it (FP8 as
    `uint8`: gloo refuses float8). The sender checks its own pairs against the layout first."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    device = group_device(group)
    for source, layout in enumerate(layouts):
        sending = source == stage
        it = iter(mine) if sending else None
        for name, shape, dtype in layout:
            if sending:
                got, tensor = next(it, (None, None))
                if (got, tuple(tensor.shape) if tensor is not None else None, getattr(tensor, "dtype", None)) != (
                    name,
                    shape,
                    dtype,
                ):
                    raise RuntimeError(
                        f"pipeline stage {stage} streams {got!r} {getattr(tensor, 'shape', None)} "
                        f"{getattr(tensor, 'dtype', None)} where the mapping table has {name!r} {shape} {dtype}"
                    )
                wire = tensor.detach().contiguous()
            else:
                wire = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(wire_bytes(wire), src=ranks[source], group=group)
            yield name, wire
        if sending and next(it, None) is not None:
            raise RuntimeError(f"pipeline stage {stage} streams more tensors than the mapping table gives it")


def drain(pairs) -> None:
    """Run a stream to its end without keeping anything (a rank's share of the collective gathers)."""
    for _ in pairs:
        pass
