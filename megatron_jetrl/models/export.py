"""The (hf_name, tensor) stream that feeds both the on-disk converter and the live weight sync.

One mapping (megatron_jetrl.models.mapping) plus one quantizer: FP8 linears come out as
`<name>.weight` (E4M3) + `<name>.weight_scale_inv` (FP32, [ceil(N/128), ceil(K/128)]), the rest in BF16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, scale_shape
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.mapping import Entry, gather_ranks, to_hf

RankTensors = Callable[[str], list[torch.Tensor]]
RankFP8 = Callable[[str], list[QuantizedWeight]]


def quantize_ranks(fetch: RankTensors, flow: PrecisionFlow) -> RankFP8:
    """FP8 weights for each TP rank's shard, quantized as the trainer's forward quantizes them."""
    return lambda name: [QuantizedWeight.quantize(t, flow) for t in fetch(name)]


def hf_shape(arch: ModelArch, name: str) -> tuple[int, ...]:
    """Shape of HF tensor `name` of this architecture."""
    h, hd = arch.hidden_size, arch.head_dim
    if name.endswith(("attn.q_scale", "attn.k_scale", "attn.v_scale")):
        return (1,)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (hd,)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return (h,)
    if "embed_tokens" in name or name.startswith("lm_head"):
        return (arch.vocab_size, h)
    rows = {
        "q_proj": arch.num_heads * hd,
        "k_proj": arch.num_kv_heads * hd,
        "v_proj": arch.num_kv_heads * hd,
        "o_proj": h,
        "gate_proj": arch.intermediate_size,
        "up_proj": arch.intermediate_size,
        "down_proj": h,
    }
    cols = {"o_proj": arch.num_heads * hd, "down_proj": arch.intermediate_size}
    for key, r in rows.items():
        if f".{key}." in name:
            return (r,) if name.endswith(".bias") else (r, cols.get(key, h))
    raise KeyError(f"no known HF shape for {name!r}")


def stream_layout(
    arch: ModelArch, flow: PrecisionFlow, entries: list[Entry], *, dtype: torch.dtype = torch.bfloat16
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every pair `hf_tensors` yields for `entries`, in its order, without a tensor: what an
    engine expects of a whole stream, and what a receiver allocates before a pipeline stage's bytes arrive."""
    out = []
    for entry in entries:
        for name in entry.hf:
            shape = hf_shape(arch, name)
            if entry.fp8 and flow.rollout_fp8:
                out += [
                    (name, shape, torch.float8_e4m3fn),
                    (name.removesuffix("weight") + "weight_scale_inv", scale_shape(shape, (128, 128)), torch.float32),
                ]
            else:
                out.append((name, shape, torch.float32 if entry.fp32 else dtype))
    return out


def _gather(entry: Entry, arch: ModelArch, per_rank: list[torch.Tensor], unit: int, hf_rows: int | None):
    pieces = [to_hf(entry, arch, t, unit) for t in per_rank]
    for name in entry.hf:
        yield name, gather_ranks(entry, [p[name] for p in pieces], hf_rows)


def hf_tensors(
    arch: ModelArch,
    flow: PrecisionFlow,
    entries: list[Entry],
    fetch: RankTensors,
    fetch_fp8: RankFP8 | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF (name, tensor) pairs for `entries`.

    `fetch(megatron_name)` returns that parameter's tensor on every TP rank, in rank order;
    `fetch_fp8(megatron_name)` the FP8 weights the trainer used (default: quantize `fetch`'s shards,
    which gives the same bytes: the quantizer is deterministic and shards are block-aligned).
    """
    fetch_fp8 = fetch_fp8 or quantize_ranks(fetch, flow)
    for entry in entries:
        hf_rows = arch.vocab_size if entry.vocab else None
        if entry.fp8 and flow.rollout_fp8:
            weights = fetch_fp8(entry.megatron)
            data = _gather(entry, arch, [w.q.view(torch.uint8) for w in weights], 1, hf_rows)
            scales = _gather(entry, arch, [w.s for w in weights], 128, hf_rows)
            for (name, q), (_, s) in zip(data, scales):
                yield name, q.view(torch.float8_e4m3fn)
                yield name.removesuffix("weight") + "weight_scale_inv", s
        else:
            for name, tensor in _gather(entry, arch, fetch(entry.megatron), 1, hf_rows):
                yield name, tensor.to(torch.float32 if entry.fp32 else dtype)
