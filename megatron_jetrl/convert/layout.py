"""Expected HF tensor names, shapes and dtypes of a family's checkpoint, and the local Megatron shapes
of each TP rank -- derived from the one mapping table (models.mapping) on `meta` tensors, never by a
second hand-written table of layouts."""

from __future__ import annotations

import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.export import hf_shape, stream_layout
from megatron_jetrl.models.mapping import Entry, from_hf, model_entries, rank_slice

BLOCK = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_hf_tensors(arch: ModelArch, fp8: bool, kv_scales: bool = False) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of the HF checkpoint (FP8 block format when `fp8`; with the FP8 KV
    cache's per-layer Q/K/V scales when `kv_scales`)."""
    flow = PrecisionFlow(mode="jetrl" if fp8 else "bf16")
    entries = model_entries(arch, kv_scales=kv_scales)
    return {name: (dtype, shape) for name, shape, dtype in stream_layout(arch, flow, entries)}


def local_shapes(arch: ModelArch, entry: Entry, tp: int) -> list[tuple[int, ...]]:
    """Shape of `entry`'s Megatron tensor on each TP rank (vocabulary padded as Megatron pads it)."""
    from megatron_jetrl.models.mapping import padded_vocab_size

    padded = padded_vocab_size(arch.vocab_size, tp)
    full = {name: torch.empty(hf_shape(arch, name), device="meta") for name in entry.hf}
    return [
        tuple(from_hf(entry, arch, {n: rank_slice(entry, full[n], r, tp, padded) for n in entry.hf}).shape) for r in range(tp)
    ]


def rollout_tp_problems(shapes: dict[str, tuple[int, ...]], tp: int, block: int = BLOCK) -> list[str]:
    """vLLM's `validate_fp8_block_shape` rule, from a checkpoint's actual HF weight shapes, at rollout TP.

    Column-parallel pieces (q/k/v, gate/up: each fused partition) need out_rows/tp % block == 0 (at TP=1
    vLLM checks all merged partitions but the last); row-parallel linears (o_proj, down_proj) need
    in_features/tp % block == 0.
    """
    problems = []
    for name, shape in sorted(shapes.items()):
        if len(shape) != 2 or not name.endswith(".weight"):
            continue
        if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            last_merged = ".v_proj." in name or ".up_proj." in name
            if tp == 1 and last_merged:
                continue
            rows = shape[0]
            if rows % tp or (rows // tp) % block:
                problems.append(f"{name}: output rows {rows} / TP {tp} = {rows / tp:g} is not a multiple of {block}")
        elif ".o_proj." in name or ".down_proj." in name:
            cols = shape[1]
            if tp > 1 and (cols % tp or (cols // tp) % block):
                problems.append(f"{name}: input size {cols} / TP {tp} = {cols / tp:g} is not a multiple of {block}")
    return problems
