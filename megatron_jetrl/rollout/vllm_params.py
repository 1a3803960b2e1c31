"""Where the trainer's HF tensors land in a running vLLM 0.26.0 engine: each HF name -> a slice of a fused vLLM
parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj, this rank's TP piece, vocab rows), the copy plan that checks
the live parameters have the checkpoint layout and that every one is covered, and the attention layers' FP8 KV-cache
scale buffers the sync writes (`VllmEngine.update_weights`). Plain code, tested on CPU (tests/unit/test_rollout_vllm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.native import SCALE_SUFFIX, expected_tensors
from megatron_jetrl.rollout.vllm_checks import EngineConformanceError

_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ROW_PARALLEL = ("o_proj", "down_proj")


def _is_vocab(hf_name: str) -> bool:
    return "embed_tokens" in hf_name or hf_name.startswith("lm_head")


def vllm_target(arch: ModelArch, hf_name: str, tp_rank: int = 0, tp_size: int = 1):
    """Where an HF tensor lands in vLLM's model on one TP rank.

    Returns `(vllm_name, shard_id, split_dim, dst_offset)`: vLLM's fused parameter name and its
    stacked shard id (vLLM's `stacked_params_mapping`), the dim this rank slices (0 column-parallel and
    vocab-parallel, 1 row-parallel, None replicated), and the row offset of this rank's slice inside the fused
    parameter (in rows for weights and biases, in 128-row blocks for `weight_scale_inv`).
    """
    parts = hf_name.split(".")
    module = parts[-2] if parts[-1] in ("weight", "bias", "weight_scale_inv") else None
    if module in _STACKED:
        fused, shard = _STACKED[module]
        unit = 128 if hf_name.endswith(SCALE_SUFFIX) else 1
        hd = arch.head_dim
        q_local, kv_local = arch.num_heads * hd // tp_size, arch.num_kv_heads * hd // tp_size
        inter_local = arch.intermediate_size // tp_size
        offset = {"q": 0, "k": q_local, "v": q_local + kv_local, 0: 0, 1: inter_local}[shard] // unit
        return hf_name.replace(module, fused), shard, 0, offset
    if module in _ROW_PARALLEL and not hf_name.endswith(".bias"):
        return hf_name, None, 1, 0
    if _is_vocab(hf_name):
        return hf_name, None, 0, 0
    return hf_name, None, None, 0


def rank_piece(
    arch: ModelArch, hf_name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, rows_per_rank: int | None = None
) -> torch.Tensor:
    """This rank's slice of a full HF tensor (a view; FP8 blocks never straddle ranks: `check_fp8_tp`).

    Vocab-parallel tensors (embedding, lm_head) take rows `[rank * rows_per_rank, ...)` of the vocabulary,
    `rows_per_rank` being vLLM's padded per-rank row count; the last ranks may hold fewer real rows (or none).
    """
    _, _, dim, _ = vllm_target(arch, hf_name, tp_rank, tp_size)
    if _is_vocab(hf_name):
        per = rows_per_rank or -(-tensor.shape[0] // tp_size)
        start = min(tp_rank * per, tensor.shape[0])
        return tensor[start : min(start + per, tensor.shape[0])]
    if dim is None or tp_size == 1:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{hf_name}: dim {dim} of {tuple(tensor.shape)} does not split into TP={tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes on this rank: rows `[row, row + rows)` of vLLM parameter `param`."""

    param: str
    row: int
    rows: int


def copy_plan(
    arch: ModelArch, flow: PrecisionFlow, params: dict[str, torch.Tensor], tp_rank: int = 0, tp_size: int = 1
) -> dict[str, Slot]:
    """HF name -> `Slot` for every tensor of the trainer's stream, checked against vLLM's live parameters.

    Refuses (EngineConformanceError, every problem named) when a parameter is missing, has another dtype, width
    or layout (e.g. scales re-laid out for another kernel), or when a vLLM parameter would not be written whole.
    """
    plan, problems, covered = {}, [], {}
    for hf_name, (shape, dtype) in expected_tensors(arch, flow).items():
        target, _, _, offset = vllm_target(arch, hf_name, tp_rank, tp_size)
        param = params.get(target)
        if param is None:
            if hf_name.startswith("lm_head") and arch.tie_word_embeddings:
                continue  # tied: vLLM's lm_head is the embedding
            problems.append(f"{hf_name}: vLLM has no parameter {target}")
            continue
        per = param.shape[0] if _is_vocab(hf_name) else None
        piece = rank_piece(arch, hf_name, torch.empty(shape, dtype=dtype, device="meta"), tp_rank, tp_size, per)
        if param.dtype != dtype or tuple(param.shape[1:]) != tuple(piece.shape[1:]) or not param.is_contiguous():
            problems.append(
                f"{target}: vLLM holds {tuple(param.shape)} {param.dtype} (contiguous={param.is_contiguous()}); "
                f"{hf_name} needs rows of {tuple(piece.shape[1:])} {dtype}"
            )
            continue
        if offset + piece.shape[0] > param.shape[0]:
            problems.append(f"{target}: {param.shape[0]} rows cannot take {hf_name} at row {offset} (+{piece.shape[0]})")
            continue
        plan[hf_name] = Slot(target, offset, piece.shape[0])
        covered[target] = covered.get(target, 0) + piece.shape[0]
    for name, param in params.items():
        vocab = _is_vocab(name)
        if name not in covered:
            problems.append(f"{name}: no tensor of the trainer's stream writes this vLLM parameter")
        elif covered[name] != param.shape[0] and not vocab:
            problems.append(f"{name}: the stream writes {covered[name]} of its {param.shape[0]} rows")
    if problems:
        raise EngineConformanceError(
            "vLLM's parameters do not take the trainer's tensors as they are (was a setting "
            "changed that re-lays out weights, e.g. VLLM_USE_DEEP_GEMM_E8M0?):\n  - " + "\n  - ".join(problems[:20])
        )
    return plan


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def apply_plan(
    arch: ModelArch,
    plan: dict[str, Slot],
    params: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[str]:
    """Copy every tensor of a validated batch into its slot, then compare the bytes; the names that differ."""
    checks = []
    for name, tensor in batch.items():
        slot = plan.get(name)
        if slot is None:
            continue  # lm_head of a tied model
        param = params[slot.param]
        piece = rank_piece(arch, name, tensor, tp_rank, tp_size, param.shape[0] if _is_vocab(name) else None)
        dst = param.data.narrow(0, slot.row, slot.rows)
        dst.copy_(piece)
        checks.append((name, (_bits(dst) != _bits(piece)).any()))
    if not checks:
        return []
    differ = torch.stack([c for _, c in checks]).tolist()  # one host sync for the whole model
    return [name for (name, _), bad in zip(checks, differ, strict=True) if bad]


def attention_layers(model) -> dict[str, object]:
    """HF layer prefix (`model.layers.N.self_attn`) -> vLLM's attention layer (`.attn`) of that decoder layer."""
    return {name.removesuffix(".attn"): m for name, m in model.named_modules() if name.endswith("self_attn.attn")}


def kv_scale_params(layers: dict[str, object]) -> dict[str, torch.Tensor]:
    """The mapping table's HF names of the FP8 KV cache's scales -> one-element views of the buffers vLLM's attention
    quantizes with and descales by (`_q_scale`, `_k_scale`, `_v_scale`)."""
    return {f"{prefix}.attn.{t}_scale": getattr(layer, f"_{t}_scale").view(1) for prefix, layer in layers.items() for t in "qkv"}


def sync_scale_floats(layers: dict[str, object]) -> None:
    """vLLM keeps host copies of the scales beside the buffers (read by backends other than FA3): set them too."""
    values = torch.stack([getattr(layer, f"_{t}_scale") for layer in layers.values() for t in "qkv"]).tolist()
    for i, layer in enumerate(layers.values()):
        layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = values[3 * i : 3 * i + 3]
        layer._k_scale_cpu.fill_(layer._k_scale_float)
        layer._v_scale_cpu.fill_(layer._v_scale_float)
