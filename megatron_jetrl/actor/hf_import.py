"""HF (BF16/FP32 safetensors, single file or sharded with model.safetensors.index.json) -> this rank's Megatron params.

Every TP/PP rank reads only its part: `models.mapping.model_entries` names what its pipeline stage holds,
`rank_slice_lazy` reads this TP rank's rows/columns through `safe_open(...).get_slice`, and `from_hf`
fuses q/k/v per query group and [gate; up] into fc1. No other copy of the mapping exists.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_jetrl.actor.fp8_layers import unwrap
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.mapping import from_hf, model_entries, padded_vocab_size, rank_slice_lazy

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
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    gpt = unwrap(model)
    params = dict(gpt.named_parameters())
    files = weight_files(path)
    entries = model_entries(arch, pp_rank=pp_rank, pp_size=pp, spec=spec)
    padded = padded_vocab_size(arch.vocab_size, tp)
    with ExitStack() as stack, torch.no_grad():
        handles = {}

        def read(name: str) -> torch.Tensor:
            if name not in files:
                raise KeyError(f"{path} has no tensor {name!r} (model_type {arch.family})")
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(safe_open(files[name], framework="pt"))
            sl = handles[files[name]].get_slice(name)
            return rank_slice_lazy(entry, sl.__getitem__, tuple(sl.get_shape()), tp_rank, tp, padded)

        for entry in entries:
            target = params.get(entry.megatron)
            if target is None:
                raise KeyError(f"the model has no parameter {entry.megatron!r} (layer spec vs mapping spec {spec!r})")
            tensor = from_hf(entry, arch, {name: read(name) for name in entry.hf})
            if tensor.shape != target.shape:
                raise ValueError(f"{entry.megatron}: HF gives {tuple(tensor.shape)}, this rank holds {tuple(target.shape)}")
            target.copy_(tensor)
    loaded = [e.megatron for e in entries]
    missing = sorted(set(params) - set(loaded) - {"output_layer.weight"})
    if missing:
        raise KeyError(f"parameters not covered by the HF mapping: {missing}")
    if arch.tie_word_embeddings and pp > 1:
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
