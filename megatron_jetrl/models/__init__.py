"""Model families: HF config <-> Megatron config, and the one name/layout mapping table per family."""

from megatron_jetrl.models.arch import FAMILIES, ModelArch
from megatron_jetrl.models.export import hf_tensors
from megatron_jetrl.models.mapping import (
    Entry,
    from_hf,
    gather_ranks,
    layer_entries,
    model_entries,
    padded_vocab_size,
    rank_slice,
    to_hf,
)

__all__ = [
    "FAMILIES",
    "Entry",
    "ModelArch",
    "from_hf",
    "gather_ranks",
    "hf_tensors",
    "layer_entries",
    "model_entries",
    "padded_vocab_size",
    "rank_slice",
    "to_hf",
]
