"""Actor checkpoint (Megatron TP x PP shards, models.shards layout) -> HF safetensors directory.

The converter is a *sink* of `models.export.hf_tensors`, the same (hf_name, tensor) iterator the live
weight sync feeds to a rollout engine: FP8 linears are quantized per TP shard with
`QuantizedWeight.quantize` -- the trainer's forward quantizer -- and the shards' bytes and scale grids
are concatenated, so the exported bytes are the trainer's and do not depend on the trainer's TP.

Everything that can be wrong with the input (family, shards, TP/PP metadata, FP8 block alignment at
the trainer's and the rollout's TP) is checked by `plan()` before any output exists.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_jetrl.convert.hf_writer import HFCheckpointWriter, parse_size
from megatron_jetrl.convert.layout import local_shapes
from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.export import hf_tensors
from megatron_jetrl.models.mapping import Entry, model_entries, stage_layers
from megatron_jetrl.models.shards import CheckpointError, ShardedCheckpoint, shard_name

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
IGNORED_SUFFIXES = ("._extra_state",)  # TE/Megatron FP8 metadata, not parameters
DTYPES = ("fp8", "bf16")
QUANT_ROWS = 1024


def rollout_hf_config(hf_config: dict, arch: ModelArch, flow: PrecisionFlow) -> dict:
    """config.json of a rollout checkpoint: the model's, BF16, with the flow's quantization_config (FP8 rollout)."""
    config = dict(hf_config)
    config.pop("quantization_config", None)
    config.setdefault("architectures", [ARCHITECTURES[arch.family]])
    config["torch_dtype"] = "bfloat16"
    if flow.rollout_fp8:
        config["quantization_config"] = flow.quantization_config()
    return config


class ConversionError(ValueError):
    """The input cannot be converted as asked; nothing was written."""


@dataclass
class Plan:
    checkpoint: ShardedCheckpoint
    arch: ModelArch
    flow: PrecisionFlow
    """The flow of the export (`bf16` for --dtype bf16)."""
    source_flow: PrecisionFlow
    dtype: str
    rollout_tp: int
    stages: list[list[Entry]] = field(default_factory=list)
    spec: str = "local"
    """The checkpoint's layer spec (meta.json): `te` with an FP8-trained flow exports TE's weight bytes."""
    kv_scales: torch.Tensor | None = None
    """`[layers, 3]` Q/K/V scales of the FP8 KV cache the run decided last (its `trainer_state.json`), exported with an
    FP8 checkpoint of a run whose trainer decided them: a vLLM started with `kv_cache_dtype="fp8"` loads them."""

    @property
    def fp8(self) -> bool:
        return self.flow.rollout_fp8

    @property
    def num_tensors(self) -> int:
        weights = sum(len(e.hf) * (2 if (e.fp8 and self.fp8) else 1) for stage in self.stages for e in stage)
        return weights + (0 if self.kv_scales is None else self.kv_scales.numel())

    def hf_config(self) -> dict:
        return rollout_hf_config(self.checkpoint.meta["hf_config"], self.arch, self.flow)

    def tensors(self, quant_rows: int | None = None):
        """The (hf_name, tensor) stream of the whole model, pipeline stage after pipeline stage."""
        for pp_rank, entries in enumerate(self.stages):
            fetch = self.checkpoint.fetch(pp_rank)
            yield from hf_tensors(
                self.arch,
                self.flow,
                entries,
                fetch,
                quantize_ranks_in_rows(fetch, self.flow, quant_rows or QUANT_ROWS, self.weight_quantizer()),
            )
        if self.kv_scales is not None:  # the mapping table's KV scale entries, numbered as at PP 1
            entries = [e for e in model_entries(self.arch, kv_scales=True) if e.fp32]
            rows = {e.megatron: [self.kv_scales[i]] for i, e in enumerate(entries)}
            yield from hf_tensors(self.arch, self.flow, entries, rows.__getitem__)

    def weight_quantizer(self):
        """`QuantizedWeight.quantize`, or for a TE-spec checkpoint trained in FP8 `fp8.te.te_quantize_weight`: TE's
        128x128 numerics (`x * RN(448/amax)`, scale_inv = 1/scale), the bytes its forward ran -- with fp32 scales
        they differ from ours in a few elements and scale ulps, so the rollout gets exactly what TE trained with."""
        if self.spec == "te" and self.source_flow.train_fp8 and self.flow.rollout_fp8:
            from megatron_jetrl.fp8.te import te_quantize_weight

            return te_quantize_weight
        return QuantizedWeight.quantize


def quantize_ranks_in_rows(fetch, flow: PrecisionFlow, rows: int = QUANT_ROWS, quantize_weight=None):
    """`QuantizedWeight.quantize` of every TP shard, run on slices of `rows` rows (a multiple of 128).

    128x128 blocks are quantized independently (amax, scale and bytes depend on the block alone), so
    slicing along whole block rows gives the same bytes and scales as one call on the whole shard --
    the trainer's bytes -- while the quantizer's FP32 temporaries (~16 bytes per element) cover one
    slice instead of the largest parameter.
    """
    if rows % 128:
        raise ValueError(f"rows must be a multiple of 128, got {rows}")
    quantize_weight = quantize_weight or QuantizedWeight.quantize

    def quantize(weight: torch.Tensor) -> QuantizedWeight:
        if weight.shape[0] <= rows:
            return quantize_weight(weight, flow)
        parts = [quantize_weight(weight[i : i + rows], flow) for i in range(0, weight.shape[0], rows)]
        return QuantizedWeight(
            torch.cat([p.q.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn), torch.cat([p.s for p in parts])
        )

    return lambda name: [quantize(t) for t in fetch(name)]


def _export_flow(source: PrecisionFlow, dtype: str) -> PrecisionFlow:
    if dtype == "bf16":
        return PrecisionFlow(mode="bf16")
    if source.rollout_fp8:
        return source  # jetrl / bf16-train-fp8-rollout: the rollout quantizer is the trainer's flow's
    # a BF16-trained actor exported for an FP8 rollout: the standard quantizer (fp32 scales, vLLM eps)
    return PrecisionFlow(mode="bf16-train-fp8-rollout", eps=source.eps)


def plan(checkpoint_dir: str | Path, *, dtype: str = "fp8", rollout_tp: int = 1, verify_sha256: bool = True) -> Plan:
    """Open and check an actor checkpoint for conversion. Raises ConversionError naming the problem."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if rollout_tp < 1:
        raise ConversionError(f"rollout TP must be >= 1, got {rollout_tp}")
    try:
        ckpt = ShardedCheckpoint.open(checkpoint_dir, verify=verify_sha256)
    except CheckpointError as e:
        raise ConversionError(f"cannot read the actor checkpoint: {e}") from e
    meta = ckpt.meta
    for key in ("tp", "pp", "hf_config", "flow", "spec"):
        if key not in meta:
            raise ConversionError(f"{ckpt.directory}/meta.json has no {key!r}")
    tp, pp, spec = meta["tp"], meta["pp"], meta["spec"]
    if not (isinstance(tp, int) and tp >= 1 and isinstance(pp, int) and pp >= 1):
        raise ConversionError(f"meta.json: tp={tp!r}, pp={pp!r}; both must be positive integers")
    if spec not in ("local", "te"):
        raise ConversionError(f"meta.json: layer spec {spec!r}; expected 'local' or 'te'")
    try:
        arch = ModelArch.from_hf_config(meta["hf_config"])
    except (ValueError, KeyError) as e:
        raise ConversionError(f"{ckpt.directory}: {e}") from e
    try:
        source_flow = PrecisionFlow.from_dict(meta["flow"])
    except (ValueError, TypeError) as e:
        raise ConversionError(f"meta.json flow: {e}") from e
    flow = _export_flow(source_flow, dtype)
    if flow.rollout_fp8:
        # the trainer's shards are quantized one by one: their blocks must be the full tensor's blocks
        for what, size in (("trainer", tp), ("rollout", rollout_tp)):
            try:
                arch.check_fp8_tp(size)
            except ValueError as e:
                raise ConversionError(f"FP8 export refused at {what} TP={size}: {e}") from e
    last = meta.get("pp_last_layers", 0)
    try:
        stage_layers(arch.num_layers, pp, last)
    except ValueError as e:
        raise ConversionError(f"meta.json's pipeline split (pp={pp}, pp_last_layers={last}) does not fit the model: {e}") from e
    stages = [model_entries(arch, pp_rank=p, pp_size=pp, spec=spec, last_layers=last) for p in range(pp)]
    for p, entries in enumerate(stages):
        expected = {e.megatron: e for e in entries}
        shapes = {e.megatron: local_shapes(arch, e, tp) for e in entries}
        for t in range(tp):
            name = shard_name(t, p)
            try:
                with safe_open(ckpt.directory / name, framework="pt") as f:
                    got = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            except Exception as e:  # noqa: BLE001 - safetensors raises several types on a bad header
                raise ConversionError(f"{ckpt.directory / name}: not a readable safetensors file ({e})") from e
            got = {k: v for k, v in got.items() if not k.endswith(IGNORED_SUFFIXES)}
            if arch.tie_word_embeddings and pp > 1 and p == pp - 1:
                # Megatron keeps a synced copy of the tied embedding as output_layer.weight on the last stage;
                # the HF checkpoint takes the embedding from stage 0, as the mapping does
                got.pop("output_layer.weight", None)
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            if missing or extra:
                raise ConversionError(
                    f"{name} does not hold what a {arch.family} model with {arch.num_layers} layers at TP={tp} x PP={pp} "
                    f"(layer spec {spec!r}) puts on TP rank {t}, PP rank {p}: "
                    + (f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}; " if missing else "")
                    + (f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}" if extra else "")
                    + " -- is meta.json's tp/pp/spec the one the checkpoint was saved with?"
                )
            for key, entry in expected.items():
                shape, st_dtype = got[key]
                want = shapes[key][t]
                if st_dtype not in ("BF16", "F16", "F32"):
                    raise ConversionError(f"{name}: {key} has dtype {st_dtype}; expected BF16/F16/F32 parameters")
                if entry.vocab:
                    ok = len(shape) == 2 and shape[1] == want[1] and shape[0] * tp >= arch.vocab_size
                else:
                    ok = shape == want
                if not ok:
                    raise ConversionError(
                        f"{name}: {key} has shape {list(shape)}, but TP rank {t} of TP={tp} holds {list(want)} "
                        f"for this {arch.family} config -- TP/PP metadata and shards disagree"
                    )
    return Plan(
        ckpt, arch, flow, source_flow, dtype, rollout_tp, stages, spec, _kv_scales(ckpt.directory, arch, source_flow, flow)
    )


def _kv_scales(directory: Path, arch: ModelArch, source: PrecisionFlow, flow: PrecisionFlow) -> torch.Tensor | None:
    """The FP8 KV cache's last scales from the checkpoint's `trainer_state.json`, where the run's trainer decided them
    and the export is FP8; None otherwise (also for a checkpoint saved without a trainer state, e.g. converted alone)."""
    state = Path(directory) / "trainer_state.json"
    if not (source.trainer_kv_scales and flow.rollout_fp8 and state.is_file()):
        return None
    try:
        saved = json.loads(state.read_text()).get("kv_scales")
        scales = None if saved is None else torch.tensor(saved["scales"], dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{state}: unreadable kv_scales ({e})") from e
    if scales is not None and (scales.shape != (arch.num_layers, 3) or not bool((torch.isfinite(scales) & (scales > 0)).all())):
        raise ConversionError(
            f"{state}: kv_scales must be {arch.num_layers} x 3 finite positive scales, got {tuple(scales.shape)}"
        )
    return scales


@dataclass
class ConvertResult:
    output: Path
    files: list[str]
    total_size: int
    num_tensors: int
    seconds: float
    peak_pending_bytes: int


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in requirements
        return None
    return tqdm(total=total, unit="tensor", desc="convert", dynamic_ncols=True)


def convert(
    checkpoint_dir: str | Path,
    output: str | Path,
    *,
    dtype: str = "fp8",
    rollout_tp: int = 1,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    tokenizer_dir: str | Path | None = None,
    progress: bool = False,
    verify_sha256: bool = True,
    on_shard=None,
) -> ConvertResult:
    """Convert an actor checkpoint to an HF directory (see the module docstring and tools/convert_checkpoint.py);
    `on_shard(path)` is called as each safetensors shard is written."""
    start = time.perf_counter()
    output = Path(output).resolve()
    source = Path(checkpoint_dir).resolve()
    if output == source or source in output.parents:
        raise ConversionError(f"output {output} is inside the input checkpoint {source}")
    if output.exists() and not force:
        raise ConversionError(f"{output} exists; pass --force to replace it (it is replaced only once the new one is complete)")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ConversionError(f"bad shard size {max_shard_size!r}: {e}") from e
    copies = []
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        if not tokenizer_dir.is_dir():
            raise ConversionError(f"tokenizer directory {tokenizer_dir} does not exist")
        copies = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
        if not copies:
            raise ConversionError(f"{tokenizer_dir} holds none of the tokenizer files {list(TOKENIZER_FILES)}")
    p = plan(checkpoint_dir, dtype=dtype, rollout_tp=rollout_tp, verify_sha256=verify_sha256)

    writer = HFCheckpointWriter(output, max_shard_bytes=max_bytes, overwrite=force, on_shard=on_shard)
    bar = _progress(p.num_tensors, progress)
    count = 0
    try:
        for name, tensor in p.tensors():
            writer.add(name, tensor)
            count += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{writer.total_size / 2**20:.0f} MiB", refresh=False)
        if count != p.num_tensors:  # a mapping/export bug, not an input problem
            raise RuntimeError(f"export yielded {count} tensors, the mapping says {p.num_tensors}")
        config = p.hf_config()
        writer.write_json("config.json", config)
        gen = tokenizer_dir / "generation_config.json" if tokenizer_dir is not None else None
        if gen is not None and gen.is_file():
            writer.copy_file(gen)
        else:
            writer.write_json(
                "generation_config.json",
                {
                    "_from_model_config": True,
                    **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None},
                },
            )
        for src in copies:
            writer.copy_file(src)
        meta = p.checkpoint.meta
        out = writer.finish(
            index_metadata={"format": "fp8-block128" if p.fp8 else "bf16"},
            manifest_extra={
                "dtype": dtype,
                "quantization_config": p.flow.quantization_config(),
                "flow": p.flow.to_dict(),
                "rollout_tp_checked": rollout_tp,
                "kv_scales": p.kv_scales is not None,
                "source": {
                    "directory": str(source),
                    "iteration": meta.get("iteration"),
                    "tp": meta["tp"],
                    "pp": meta["pp"],
                    "spec": meta["spec"],
                    "flow": meta["flow"],
                    "shards": [{"file": s["file"], "sha256": s["sha256"]} for s in meta["shards"]],
                },
            },
        )
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    files = sorted(x.name for x in out.iterdir())
    return ConvertResult(out, files, writer.total_size, count, time.perf_counter() - start, writer.peak_pending_bytes)


def read_manifest(directory: str | Path) -> dict:
    from megatron_jetrl.convert.hf_writer import MANIFEST_NAME

    return json.loads((Path(directory) / MANIFEST_NAME).read_text())


__all__ = ["ConversionError", "ConvertResult", "Plan", "convert", "plan", "read_manifest"]
