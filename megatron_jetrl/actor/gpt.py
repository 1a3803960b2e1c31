"""GPTModel-level helpers that the layer specs (`fp8_layers`, `te_recipe`) and the provider share: megatron's RoPE
arguments for an architecture, and the GPTModel inside megatron's wrappers. Nothing here imports megatron, so the
specs read them without importing the provider, which imports the specs.
"""

from __future__ import annotations

from megatron_jetrl.models.arch import ModelArch

LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_kwargs(arch: ModelArch) -> dict:
    """GPTModel RoPE arguments; llama3 rope_scaling only with megatron's fixed low/high/original factors."""
    kwargs = {"position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_base": arch.rope_theta}
    scaling = arch.rope_scaling
    if not scaling:
        return kwargs
    kind = scaling.get("rope_type", scaling.get("type"))
    odd = {k: scaling.get(k) for k, v in LLAMA3_ROPE_DEFAULTS.items() if float(scaling.get(k, v)) != v}
    if kind != "llama3" or odd:
        raise ValueError(f"rope_scaling {scaling} is not supported: megatron-core 0.16 implements llama3 scaling with {LLAMA3_ROPE_DEFAULTS} only")
    return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def unwrap(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
