"""GPTModel-level helpers that the layer specs (`fp8_layers`, `te_recipe`) and the provider share: megatron's RoPE
arguments for an architecture, the GPTModel inside megatron's wrappers, and the mapping entries of a built model's
pipeline stage. Nothing here imports megatron at import time, so the specs read them without importing the provider,
which imports the specs.
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
        raise ValueError(
            f"rope_scaling {scaling} is not supported: megatron-core 0.16 implements llama3 scaling with {LLAMA3_ROPE_DEFAULTS} only"
        )
    return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def unwrap(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_spec(model) -> str:
    """The mapping naming of a model built by `actor.provider.build_model`: 'local' or 'te'."""
    options = getattr(unwrap(model), "actor_options", None)
    return "te" if getattr(options, "spec", "local") == "te" else "local"


def stage_entries(
    model, arch: ModelArch, *, pp_rank: int | None = None, spec: str | None = None, kv_scales: bool = False
) -> list:
    """The mapping table's entries (`models.mapping.model_entries`) of pipeline stage `pp_rank` (default: this rank's)
    of a model built by `actor.provider.build_model`: its layer spec's names (or `spec`'s) and its layer split
    (`kv_scales`: with its attention's FP8 KV cache scales)."""
    from megatron.core import parallel_state as ps

    from megatron_jetrl.models.mapping import model_entries

    return model_entries(
        arch,
        pp_rank=ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank,
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        spec=spec or model_spec(model),
        last_layers=pp_last_layers(model),
        kv_scales=kv_scales,
    )


def pp_last_layers(model) -> int:
    """The uneven pipeline split a model was built with (`ActorOptions.pp_last_layers`; 0: even)."""
    return getattr(getattr(unwrap(model), "actor_options", None), "pp_last_layers", 0)
