"""The one Megatron <-> HF mapping table of the Qwen2/Qwen3/Llama families, for import, export and live sync.

Megatron-core (local and TE layer specs, 0.16) stores per layer:
    linear_qkv   [groups x (q_per_group*hd + hd + hd), hidden]   q/k/v fused per query group
    linear_fc1   [gate; up] on every TP rank                       gated MLP fused
    linear_proj, linear_fc2                                         row-parallel (input dim split)
A tensor-parallel rank holds whole query groups of `linear_qkv`, its share of gate and of up in
`linear_fc1`, and a slice of the input dim of the row-parallel linears.

Everything here works on *one TP rank's* tensor at a time: `to_hf` cuts a rank's tensor into its pieces
of each HF tensor, `from_hf` fuses a rank's pieces back. The HF tensor is the concatenation of the ranks'
pieces along `tp_dim`. The same code cuts BF16 weights, FP8 bytes (`unit=1`) and their 128x128 scale
grids (`unit=128`: rows counted in blocks), which is what makes converter and weight sync agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_jetrl.models.arch import ModelArch

FP8_SUFFIX = ("weight", "weight_scale_inv")


@dataclass(frozen=True)
class Entry:
    megatron: str
    """Megatron-core parameter name; `{i}` is the layer index (local to a pipeline stage)."""
    hf: tuple[str, ...]
    """HF tensor names this parameter holds, in fused order; `{i}` is the global layer index."""
    fuse: str = "none"
    """`none`, `qkv` (per-query-group interleave), `gate_up` ([gate; up] on every rank) or `stack` (one row per HF
    tensor: the KV-cache scales `[q, k, v]`)."""
    tp_dim: int | None = None
    """Dimension split across TP ranks (0: column-parallel/vocab, 1: row-parallel input), None: replicated."""
    fp8: bool = False
    """A linear weight that the FP8 rollout checkpoint stores as E4M3 + `weight_scale_inv`."""
    vocab: bool = False
    """Rows are the (padded) vocabulary."""
    fp32: bool = False
    """FP32 values kept in FP32 in every stream (the FP8 KV cache's per-layer Q/K/V scales), not cast to BF16."""

    def at(self, local_layer: int, global_layer: int) -> Entry:
        return Entry(
            self.megatron.format(i=local_layer),
            tuple(h.format(i=global_layer) for h in self.hf),
            self.fuse,
            self.tp_dim,
            self.fp8,
            self.vocab,
            self.fp32,
        )


KV_SCALE = "decoder.layers.{i}.self_attention.core_attention.kv_scale"
"""The actor's per-layer FP8 KV cache scales `[q, k, v]` (a buffer of `actor.rollout_kernels.FA3Attention`)."""
KV_SCALE_SUFFIXES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale")
"""How the HF stream and checkpoint name those scales' tensors (`{layer}.self_attn.attn.q_scale`, ...)."""


def layer_entries(arch: ModelArch, spec: str = "local", kv_scales: bool = False) -> list[Entry]:
    """Per-layer entries. `spec="te"` names the norms as TE's fused LayerNormLinear does. `kv_scales`: with the FP8 KV
    cache's Q/K/V scales, as vLLM names them (`self_attn.attn.{q,k,v}_scale`, what its loader and our sync take)."""
    a, m, h = "decoder.layers.{i}.self_attention.", "decoder.layers.{i}.mlp.", "model.layers.{i}."
    qkv = tuple(f"{h}self_attn.{p}_proj.weight" for p in "qkv")
    te = spec == "te"
    entries = [
        Entry(
            f"{a}linear_qkv.layer_norm_weight" if te else "decoder.layers.{i}.input_layernorm.weight",
            (f"{h}input_layernorm.weight",),
        ),
        Entry(f"{a}linear_qkv.weight", qkv, "qkv", 0, fp8=True),
        Entry(f"{a}linear_proj.weight", (f"{h}self_attn.o_proj.weight",), tp_dim=1, fp8=True),
        Entry(
            f"{m}linear_fc1.layer_norm_weight" if te else "decoder.layers.{i}.pre_mlp_layernorm.weight",
            (f"{h}post_attention_layernorm.weight",),
        ),
        Entry(f"{m}linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "gate_up", 0, fp8=True),
        Entry(f"{m}linear_fc2.weight", (f"{h}mlp.down_proj.weight",), tp_dim=1, fp8=True),
    ]
    if arch.qkv_bias:
        entries.insert(2, Entry(f"{a}linear_qkv.bias", tuple(n.replace(".weight", ".bias") for n in qkv), "qkv", 0))
    if arch.qk_norm:
        entries += [
            Entry(f"{a}q_layernorm.weight", (f"{h}self_attn.q_norm.weight",)),
            Entry(f"{a}k_layernorm.weight", (f"{h}self_attn.k_norm.weight",)),
        ]
    if kv_scales:
        entries.append(Entry(KV_SCALE, tuple(f"{h}self_attn.attn.{t}_scale" for t in "qkv"), "stack", fp32=True))
    return entries


def stage_layers(num_layers: int, pp: int, last: int = 0) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as megatron-core 0.16 splits them: evenly, or with `last` > 0 layers on the
    last stage (`num_layers_in_last_pipeline_stage`, which also runs the output layer and the logprobs) and the rest
    evenly over the others. Refuses a split megatron would refuse, naming the fix."""
    if last and pp == 1:
        raise ValueError(f"parallel.pp_last_layers={last} needs pipeline stages: set parallel.pp > 1 or pp_last_layers=0")
    if last and not (0 < last < num_layers and (num_layers - last) % (pp - 1) == 0):
        raise ValueError(
            f"parallel.pp_last_layers={last}: the other {pp - 1} stage(s) must split the remaining "
            f"{num_layers - last} of num_hidden_layers={num_layers} evenly, at least one layer each"
        )
    if not last and num_layers % pp:
        raise ValueError(
            f"parallel.pp={pp} does not divide the model's {num_layers} layers (each pipeline stage holds as many): "
            f"use a pp among {[d for d in range(1, num_layers + 1) if num_layers % d == 0]}, or give the last "
            "stage its own count (parallel.pp_last_layers)"
        )
    if not last:
        return (num_layers // pp,) * pp
    return ((num_layers - last) // (pp - 1),) * (pp - 1) + (last,)


def model_entries(
    arch: ModelArch, *, pp_rank: int = 0, pp_size: int = 1, spec: str = "local", last_layers: int = 0, kv_scales: bool = False
) -> list[Entry]:
    """All entries a pipeline stage holds, with layer indices filled in (`last_layers`: `stage_layers`' uneven split;
    `kv_scales`: `layer_entries`')."""
    layers = stage_layers(arch.num_layers, pp_size, last_layers)
    first = sum(layers[:pp_rank])
    entries = []
    if pp_rank == 0:
        entries.append(Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0, vocab=True))
    for local in range(layers[pp_rank]):
        entries += [e.at(local, first + local) for e in layer_entries(arch, spec, kv_scales)]
    if pp_rank == pp_size - 1:
        entries.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",)))
        if not arch.tie_word_embeddings:
            entries.append(Entry("output_layer.weight", ("lm_head.weight",), tp_dim=0, vocab=True))
    return entries


def _piece_rows(entry: Entry, arch: ModelArch, rows: int, unit: int) -> list[int]:
    """Row counts of the pieces in one rank's fused tensor (in units of `unit` rows)."""
    if entry.fuse == "gate_up":
        return [rows // 2, rows // 2]
    hd = arch.head_dim // unit
    group = (arch.q_per_group + 2) * hd
    if rows % group:
        raise ValueError(
            f"{entry.megatron}: {rows} rows are not whole query groups of {group} (head_dim={arch.head_dim}, unit={unit})"
        )
    return [arch.q_per_group * hd, hd, hd]


def to_hf(entry: Entry, arch: ModelArch, local: torch.Tensor, unit: int = 1) -> dict[str, torch.Tensor]:
    """Cut one TP rank's tensor into that rank's pieces of each HF tensor."""
    if entry.fuse == "none":
        return {entry.hf[0]: local}
    if entry.fuse == "stack":
        return dict(zip(entry.hf, local.split(1), strict=True))
    sizes = _piece_rows(entry, arch, local.shape[0], unit)
    if entry.fuse == "gate_up":
        return dict(zip(entry.hf, local.split(sizes, dim=0)))
    groups = local.shape[0] // sum(sizes)
    grouped = local.reshape(groups, sum(sizes), *local.shape[1:])
    return {name: part.reshape(-1, *local.shape[1:]) for name, part in zip(entry.hf, grouped.split(sizes, dim=1))}


def from_hf(entry: Entry, arch: ModelArch, pieces: dict[str, torch.Tensor], unit: int = 1) -> torch.Tensor:
    """Fuse one TP rank's pieces of the HF tensors into that rank's Megatron tensor."""
    parts = [pieces[name] for name in entry.hf]
    if entry.fuse == "none":
        return parts[0]
    if entry.fuse in ("gate_up", "stack"):
        return torch.cat(parts, dim=0)
    hd = arch.head_dim // unit
    groups = parts[1].shape[0] // hd
    grouped = [p.reshape(groups, -1, *p.shape[1:]) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:])


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def rank_slice(entry: Entry, full: torch.Tensor, tp_rank: int, tp: int, padded_rows: int | None = None) -> torch.Tensor:
    """This TP rank's slice of a full HF tensor (the vocabulary padded with zero rows first)."""
    if entry.vocab and padded_rows is not None and padded_rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    if entry.tp_dim is None or tp == 1:
        return full
    if full.shape[entry.tp_dim] % tp:
        raise ValueError(f"{entry.hf}: dim {entry.tp_dim} of size {full.shape[entry.tp_dim]} does not split into TP={tp} parts")
    return full.chunk(tp, dim=entry.tp_dim)[tp_rank]


def rank_slice_lazy(
    entry: Entry, get, shape: tuple[int, ...], tp_rank: int, tp: int, padded_rows: int | None = None
) -> torch.Tensor:
    """`rank_slice` without reading the full tensor: `get(index)` returns `full[index]` (e.g. a safetensors
    `safe_open(...).get_slice(name)`, which reads only those bytes); `shape` is the full tensor's shape."""
    full_rows = shape[0]
    rows = padded_rows if entry.vocab and padded_rows is not None and padded_rows > full_rows else full_rows
    dim = entry.tp_dim if entry.tp_dim is not None and tp > 1 else None
    size = rows if dim == 0 else (shape[dim] if dim is not None else None)
    if dim is not None and size % tp:
        raise ValueError(f"{entry.hf}: dim {dim} of size {size} does not split into TP={tp} parts")
    if dim == 1:
        part = size // tp
        return get((slice(None), slice(tp_rank * part, (tp_rank + 1) * part)))
    start, stop = (tp_rank * rows // tp, (tp_rank + 1) * rows // tp) if dim == 0 else (0, rows)
    end = min(stop, full_rows)  # rows past the HF vocabulary are zero padding
    if start >= end:  # all padding; one row read gives the dtype
        return get(slice(0, 1)).new_zeros(stop - start, *shape[1:])
    data = get(slice(start, end))
    return torch.cat([data, data.new_zeros(stop - end, *shape[1:])]) if stop > end else data


def gather_ranks(entry: Entry, rank_pieces: list[torch.Tensor], hf_rows: int | None = None) -> torch.Tensor:
    """The full HF tensor from every TP rank's piece (vocabulary padding stripped)."""
    full = rank_pieces[0] if len(rank_pieces) == 1 or entry.tp_dim is None else torch.cat(rank_pieces, dim=entry.tp_dim)
    if entry.vocab and hf_rows is not None:
        full = full[:hf_rows]
    return full
