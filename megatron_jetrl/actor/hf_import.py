"""HF (BF16/FP32 safetensors, single file or sharded with model.safetensors.index.json) -> this rank's Megatron params,
and the random init drawn the same way.

Every TP/PP rank reads only its part: `models.mapping.model_entries` names what its pipeline stage holds,
`rank_slice_lazy` reads this TP rank's rows/columns through `safe_open(...).get_slice`, and `from_hf`
fuses q/k/v per query group and [gate; up] into fc1. No other copy of the mapping exists.

`init_hf_weights` draws a random init per HF tensor, from a generator seeded by (seed, tensor name), and places it
through the same mapping: the initial weights depend on the seed alone, not on TP, PP or the layer spec, so runs of
two layouts (a TP sweep, PP against PP 1, the local spec against TE's) start from the same policy. megatron's own
init draws from per-rank generators in construction order and gives each layout other weights.
"""

from __future__ import annotations

import json
import math
import zlib
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_jetrl.actor.fp8_layers import unwrap
from megatron_jetrl.actor.gpt import stage_entries
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.export import hf_shape
from megatron_jetrl.models.mapping import from_hf, padded_vocab_size, rank_slice, rank_slice_lazy

INDEX = "model.safetensors.index.json"


def weight_files(path: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    path = Path(path)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} has neither {INDEX} nor model.safetensors")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_hf_weights(model, arch: ModelArch, path: str | Path, spec: str = "local") -> list[str]:
    """Copy this rank's share of the HF checkpoint at `path` into `model` (a GPTModel, possibly DDP-wrapped).

    Call on every rank (with tied embeddings and PP > 1 megatron copies the embedding to the last stage by
    an all-reduce). Returns the megatron names loaded. `spec`: the mapping's parameter naming (`local`
    for the native spec, `te` for TE's fused norm names).
    """
    files = weight_files(path)
    with ExitStack() as stack:
        handles = {}

        def read(entry, name: str, tp_rank: int, tp: int, padded: int) -> torch.Tensor:
            if name not in files:
                raise KeyError(f"{path} has no tensor {name!r} (model_type {arch.family})")
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(safe_open(files[name], framework="pt"))
            sl = handles[files[name]].get_slice(name)
            return rank_slice_lazy(entry, sl.__getitem__, tuple(sl.get_shape()), tp_rank, tp, padded)

        return _place(model, arch, read, spec)


INIT_STD = 0.02
"""megatron's `init_method_std`: the linears and embeddings draw N(0, 0.02^2); o_proj and down_proj, which add into the
residual stream, N(0, (0.02 / sqrt(2 x layers))^2) as megatron's scaled output init; norms start at 1, biases at 0."""


def init_hf_weights(model, arch: ModelArch, seed: int, spec: str = "local") -> list[str]:
    """Draw this rank's share of a random init that depends on `seed` and the HF tensor names alone (module doc);
    collective like `load_hf_weights`. Each full tensor is drawn on the model's device and sliced."""
    device = next(unwrap(model).parameters()).device

    def read(entry, name: str, tp_rank: int, tp: int, padded: int) -> torch.Tensor:
        return rank_slice(entry, draw_hf_tensor(arch, name, seed, device), tp_rank, tp, padded)

    return _place(model, arch, read, spec)


def draw_hf_tensor(arch: ModelArch, name: str, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """HF tensor `name` of the random init for `seed` (FP32), from its own generator: the same on every rank."""
    shape = hf_shape(arch, name)
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    std = INIT_STD / math.sqrt(2 * arch.num_layers) if (".o_proj." in name or ".down_proj." in name) else INIT_STD
    g = torch.Generator(device=device).manual_seed(seed * 0x9E3779B1 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=device).mul_(std)


def _place(model, arch: ModelArch, read, spec: str) -> list[str]:
    """Copy `read(entry, hf_name, tp_rank, tp, padded_vocab)` -- this rank's slice of each HF tensor -- into the
    parameters of this rank's pipeline stage, fused through the mapping table."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gpt = unwrap(model)
    params = dict(gpt.named_parameters())
    entries = stage_entries(model, arch, spec=spec)
    padded = padded_vocab_size(arch.vocab_size, tp)
    with torch.no_grad():
        for entry in entries:
            target = params.get(entry.megatron)
            if target is None:
                raise KeyError(f"the model has no parameter {entry.megatron!r} (layer spec vs mapping spec {spec!r})")
            tensor = from_hf(entry, arch, {name: read(entry, name, tp_rank, tp, padded) for name in entry.hf})
            if tensor.shape != target.shape:
                raise ValueError(f"{entry.megatron}: HF gives {tuple(tensor.shape)}, this rank holds {tuple(target.shape)}")
            target.copy_(tensor)
    loaded = [e.megatron for e in entries]
    missing = sorted(set(params) - set(loaded) - {"output_layer.weight"})
    if missing:
        raise KeyError(f"parameters not covered by the HF mapping: {missing}")
    if arch.tie_word_embeddings and ps.get_pipeline_model_parallel_world_size() > 1:
        _copy_embedding_to_last_stage(gpt)
    return loaded


def _copy_embedding_to_last_stage(gpt) -> None:
    """megatron's tied-embedding sync (LanguageModule.setup_embeddings_and_output_layer: zero the last
    stage's copy, all-reduce over the embedding group) without its `.cuda()` call."""
    if not gpt._is_in_embd_group():
        return
    weight = gpt.shared_embedding_or_output_weight()
    with torch.no_grad():
        if not gpt.pre_process:
            weight.zero_()
        torch.distributed.all_reduce(weight.data, group=gpt.embd_group)
