"""Megatron TP x PP actor shards -> HF FP8 block-quantized (or BF16) safetensors, and its checks.

`converter.convert` is a sink of `models.export.hf_tensors` -- the same (hf_name, tensor) stream as the
live weight sync -- writing through `hf_writer.HFCheckpointWriter` (size-capped shards, index,
sha256 manifest, staging directory renamed into place at the end). `verify` checks an emitted
directory against the rollout's rules (names, dtypes, shapes, 128-block alignment at a rollout TP).
"""

from megatron_jetrl.convert.converter import ConversionError, ConvertResult, Plan, convert, plan
from megatron_jetrl.convert.hf_writer import HFCheckpointWriter, OutputExistsError, parse_size, verify_manifest

__all__ = [
    "ConversionError",
    "ConvertResult",
    "HFCheckpointWriter",
    "OutputExistsError",
    "Plan",
    "convert",
    "parse_size",
    "plan",
    "verify_manifest",
]
