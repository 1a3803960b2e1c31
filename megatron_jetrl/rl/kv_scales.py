"""The FP8 KV cache's scales when the trainer decides them (`PrecisionFlow.kv_scales`: amax, running_max, fixed).

Each layer's attention (`actor.rollout_kernels.FA3Attention(kv_fp8=True)`) keeps the largest |q|, |k| and |v| its
forwards saw since the last sync (`kv_amax`) and quantizes with `kv_scale`. At every sync, before the weights stream,
`refresh` takes the amax of every layer from every rank (one MAX all-reduce of a `[layers, 3]` tensor: TP ranks see
their own heads, pipeline stages their own layers, data-parallel replicas their own rows), decides the next scales by
the policy and writes them into every rank's attention; the weight stream then ships them to the engines with the
weights (the mapping table's `kv_scale` entry). The engine's rollout, the actor's logprob passes and the update of
that step all run at those scales, so their bytes agree. A layer that saw nothing (the first step) keeps its scale,
1.0 at start, vLLM's default for a checkpoint without scales.

`KvScaleState` is what a checkpoint records for an exact resume: the scales in use, the running max and whether
`fixed` has decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_jetrl.actor.rollout_kernels import E4M3_MAX

TINY_AMAX = 1e-10
"""Floor of an amax before its scale is taken (an all-zero tensor would give scale 0), vLLM's quantizer floor."""


@dataclass
class KvScaleState:
    """The trainer's KV scale decisions, `[layers, 3]` FP32 tensors on the CPU (columns q, k, v)."""

    scales: torch.Tensor
    running: torch.Tensor
    decided: bool = False

    @classmethod
    def start(cls, layers: int) -> KvScaleState:
        return cls(torch.ones(layers, 3), torch.zeros(layers, 3))

    def to_dict(self) -> dict:
        return {"scales": self.scales.tolist(), "running": self.running.tolist(), "decided": self.decided}

    @classmethod
    def from_dict(cls, data: dict) -> KvScaleState:
        return cls(torch.tensor(data["scales"]), torch.tensor(data["running"]), bool(data["decided"]))


def decide(policy: str, amax: torch.Tensor, state: KvScaleState) -> KvScaleState:
    """The next scales from this step's `amax` `[layers, 3]` (0: nothing seen) under `policy`; a new state."""
    if policy not in ("amax", "running_max", "fixed"):
        raise ValueError(f"the trainer decides scales by amax, running_max or fixed, not {policy!r}")
    seen = amax > 0
    running = torch.maximum(state.running, amax)
    if not seen.any() or (policy == "fixed" and state.decided):
        return KvScaleState(state.scales.clone(), running, state.decided)
    source = running if policy == "running_max" else amax
    scales = torch.where(seen, source.clamp(min=TINY_AMAX) / E4M3_MAX, state.scales)
    return KvScaleState(scales, running, True)


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Global layer index -> this rank's FP8-cache attention module of that layer."""
    from megatron_jetrl.actor.gpt import unwrap

    out = {}
    for layer in unwrap(model).decoder.layers:
        core = getattr(layer.self_attention, "core_attention", None)
        if getattr(core, "kv_fp8", False):
            out[layer.layer_number - 1] = core
    return out


def refresh(model, policy: str, state: KvScaleState) -> KvScaleState:
    """Collective over the world: every rank's amax -> the policy's scales, written into this rank's attention modules,
    their amax cleared. Returns the new state (the same on every rank)."""
    modules = attention_modules(model)
    layers = state.scales.shape[0]
    device = next(iter(modules.values())).kv_amax.device if modules else torch.device("cpu")
    amax = torch.zeros(layers, 3, device=device)
    for index, core in modules.items():
        amax[index] = core.kv_amax
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    new = decide(policy, amax.cpu(), state)
    apply(model, new)
    return new


def apply(model, state: KvScaleState) -> None:
    """Write `state.scales` into this rank's attention modules and clear their amax (a resume's first sync too)."""
    for index, core in attention_modules(model).items():
        core.kv_scale.copy_(state.scales[index])
        core.kv_amax.zero_()


def scale_metrics(state: KvScaleState) -> dict[str, float]:
    """The largest and smallest scale of each of q, k and v over the layers (the step's metrics)."""
    out = {}
    for column, name in enumerate("qkv"):
        out[f"sync/kv_scale_{name}_max"] = float(state.scales[:, column].max())
        out[f"sync/kv_scale_{name}_min"] = float(state.scales[:, column].min())
    return out
