"""Checks of an emitted HF checkpoint (FP8 block format or BF16) against what a rollout engine needs.

`verify_checkpoint` reads headers first (names, dtypes, shapes, index, manifest, 128-block alignment at
each requested rollout TP -- vLLM's `validate_fp8_block_shape` rule), then streams the tensors one at a
time: FP8 bytes hold no NaN code, scales are finite and positive (powers of two for `scale_fmt: ue8m0`),
and, against a BF16 reference checkpoint, every dequantized weight lies within the E4M3 rounding bound of
its reference element and is reported per layer. `compare_logits` runs both checkpoints in transformers.

Element bound used (q = e4m3(x / s), dequantized x' = q * s):
    |x' - x| <= 2^-4 |x|  for |x/s| >= 2^-6 (E4M3 normal: 3 mantissa bits, round to nearest)
    |x' - x| <= 2^-10 s   below (subnormal spacing 2^-9)
plus 2^-8 |x| for a reference that is itself a BF16 rounding of FP32 master weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_jetrl.convert.hf_writer import INDEX_NAME, MANIFEST_NAME, verify_manifest
from megatron_jetrl.convert.layout import expected_hf_tensors, rollout_tp_problems
from megatron_jetrl.fp8.quant import dequantize_blockwise, quantize_blockwise
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.mapping import KV_SCALE_SUFFIXES

ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
EXPECTED_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
REL_BOUND = 2.0**-4 + 2.0**-8
SUB_BOUND = 2.0**-10


class HFCheckpoint:
    """Lazy reader of an HF safetensors directory (index or single file)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise FileNotFoundError(f"{self.directory} has no config.json")
        self.config = _json(self.directory / "config.json")
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = _json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map mapping (damaged index)")
            self.weight_map = weight_map
        elif (self.directory / "model.safetensors").is_file():
            with _open(self.directory / "model.safetensors") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.directory} has neither {INDEX_NAME} nor model.safetensors")

    def headers(self) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[str]]:
        """name -> (safetensors dtype, shape) from every file's header, and index problems."""
        out, problems = {}, []
        for file in sorted(set(self.weight_map.values())):
            path = self.directory / file
            if not path.is_file():
                problems.append(f"{file}: listed in the index but missing")
                continue
            with _open(path) as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
                    if self.weight_map.get(k) != file:
                        problems.append(f"{k}: stored in {file}, the index says {self.weight_map.get(k)}")
        for k, file in self.weight_map.items():
            if k not in out and (self.directory / file).is_file():
                problems.append(f"{k}: the index puts it in {file}, which does not hold it")
        return out, problems

    def get(self, name: str) -> torch.Tensor:
        with _open(self.directory / self.weight_map[name]) as f:
            return f.get_tensor(name)


def _json(path: Path) -> dict:
    """A JSON object file, or ValueError naming it (truncated, corrupt, not an object)."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): truncated or corrupt") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object: corrupt")
    return data


@contextlib.contextmanager
def _open(path: Path):
    """safe_open, with an unreadable file (truncated, corrupt header or data) as a ValueError naming it."""
    from safetensors import SafetensorError

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}): truncated or corrupt") from None


@dataclass
class Report:
    directory: str
    fp8: bool
    problems: list[str] = field(default_factory=list)
    rollout_tp: dict[int, list[str]] = field(default_factory=dict)
    tensors: list[dict] = field(default_factory=list)
    logits: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and not any(self.rollout_tp.values())

    def layers(self) -> list[dict]:
        """Per-layer summary of `tensors` (worst relative error and bound ratio of the layer's linears)."""
        by_layer: dict[str, list[dict]] = {}
        for t in self.tensors:
            m = re.search(r"layers\.(\d+)\.", t["name"])
            by_layer.setdefault(m.group(1) if m else "-", []).append(t)
        rows = []
        for layer, ts in sorted(by_layer.items(), key=lambda kv: (kv[0] == "-", int(kv[0]) if kv[0].isdigit() else 0)):
            rows.append(
                {
                    "layer": layer,
                    "linears": len(ts),
                    "rel_err_max": max(t["rel_err"] for t in ts),
                    "rel_err_rms": math.sqrt(sum(t["rel_err"] ** 2 for t in ts) / len(ts)),
                    "max_abs_err": max(t["max_abs_err"] for t in ts),
                    "bound_ratio": max(t["bound_ratio"] for t in ts),
                    "requant_equal": all(t["requant_equal"] for t in ts),
                }
            )
        return rows

    def to_dict(self) -> dict:
        return {
            "directory": self.directory,
            "fp8": self.fp8,
            "ok": self.ok,
            "problems": self.problems,
            "rollout_tp": {str(k): v for k, v in self.rollout_tp.items()},
            "layers": self.layers(),
            "tensors": self.tensors,
            "logits": self.logits,
        }


def verify_checkpoint(directory: str | Path, *, rollout_tps=(1,), reference: str | Path | None = None) -> Report:
    ckpt = HFCheckpoint(directory)
    qconfig = ckpt.config.get("quantization_config")
    fp8 = qconfig is not None
    report = Report(str(directory), fp8)
    problems = report.problems
    try:
        arch = ModelArch.from_hf_config(ckpt.config)
    except (ValueError, KeyError) as e:
        problems.append(f"config.json: {e}")
        return report
    scale_mode = "fp32"
    if fp8:
        core = {k: qconfig.get(k) for k in EXPECTED_QCONFIG}
        if core != EXPECTED_QCONFIG:
            problems.append(f"config.json quantization_config {qconfig} differs from {EXPECTED_QCONFIG}")
        scale_mode = "ue8m0" if qconfig.get("scale_fmt") == "ue8m0" else "fp32"
    if (Path(directory) / MANIFEST_NAME).is_file():
        problems += [f"manifest: {p}" for p in verify_manifest(directory)]

    headers, index_problems = ckpt.headers()
    problems += index_problems
    kv_scales = fp8 and any(name.endswith(KV_SCALE_SUFFIXES) for name in headers)
    expected = expected_hf_tensors(arch, fp8, kv_scales)
    missing = sorted(set(expected) - set(headers))
    extra = sorted(set(headers) - set(expected))
    if missing:
        problems.append(f"missing tensors: {missing}")
    if extra:
        problems.append(f"unexpected tensors: {extra}")
    for name, (dtype, shape) in expected.items():
        if name in headers:
            got_dtype, got_shape = headers[name]
            if ST_DTYPES.get(got_dtype) != dtype:
                problems.append(f"{name}: dtype {got_dtype}, expected {dtype}")
            if got_shape != shape:
                problems.append(f"{name}: shape {list(got_shape)}, expected {list(shape)}")
    shapes = {n: s for n, (_, s) in headers.items()}
    for tp in rollout_tps:
        tp_problems = []
        if fp8:
            try:
                arch.check_fp8_tp(tp)
            except ValueError as e:
                tp_problems.append(str(e))
            tp_problems += rollout_tp_problems(shapes, tp)
        elif arch.num_kv_heads % tp:
            tp_problems.append(f"TP={tp} does not divide num_key_value_heads={arch.num_kv_heads}")
        report.rollout_tp[tp] = tp_problems
    if problems:
        return report

    ref = HFCheckpoint(reference) if reference is not None else None
    if ref is not None:
        ref_missing = sorted(n for n, (dt, _) in expected.items() if dt != torch.float32 and n not in ref.weight_map)
        if ref_missing:
            problems.append(f"reference {reference} lacks {ref_missing[:4]}")
            return report
    for name in (n for n in expected if n.endswith(KV_SCALE_SUFFIXES)):
        if not bool((torch.isfinite(ckpt.get(name)) & (ckpt.get(name) > 0)).all()):
            problems.append(f"{name}: KV cache scales must be finite and > 0")
    for name, (dtype, _shape) in expected.items():
        if dtype == torch.float32:
            continue
        t = ckpt.get(name)
        if dtype == torch.float8_e4m3fn:
            s = ckpt.get(name.removesuffix("weight") + "weight_scale_inv")
            nan_bytes = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
            if nan_bytes:
                problems.append(f"{name}: {nan_bytes} NaN byte(s)")
            if not bool((torch.isfinite(s) & (s > 0)).all()):
                problems.append(f"{name}_scale_inv: scales must be finite and > 0")
                continue
            if scale_mode == "ue8m0" and not bool((torch.frexp(s).mantissa == 0.5).all()):
                problems.append(f"{name}_scale_inv: scale_fmt ue8m0 but scales are not powers of two")
            if ref is not None:
                report.tensors.append(_quant_error(name, t, s, ref.get(name), scale_mode))
                if report.tensors[-1]["bound_ratio"] > 1.0:
                    problems.append(
                        f"{name}: dequantized weight exceeds the E4M3 rounding bound of the reference "
                        f"(ratio {report.tensors[-1]['bound_ratio']:.3g}): scales or bytes do not belong to it"
                    )
        elif ref is not None:
            r = ref.get(name)
            if r.shape != t.shape or not torch.equal(r.to(t.dtype).view(torch.int16), t.view(torch.int16)):
                problems.append(f"{name}: differs from the reference (BF16 tensors are copied, never changed)")
    return report


def _quant_error(name: str, q: torch.Tensor, s: torch.Tensor, ref: torch.Tensor, scale_mode: str) -> dict:
    x = ref.to(torch.float32)
    dq = dequantize_blockwise(q, s, (128, 128))
    err = (dq - x).abs()
    s_full = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    bound = REL_BOUND * x.abs() + SUB_BOUND * s_full
    rq, rs = quantize_blockwise(ref, (128, 128), scale_mode)
    return {
        "name": name,
        "rel_err": float(err.norm() / x.norm().clamp_min(1e-30)),
        "max_abs_err": float(err.max()),
        "bound_ratio": float((err / bound).max()),
        "requant_equal": bool(torch.equal(rq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs, s)),
    }


def _load_transformers(directory: Path, fp8: bool):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.bfloat16}
    if fp8:
        from transformers import FineGrainedFP8Config

        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)  # CPU: dequantize to BF16 at load
    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


def default_prompts(directory: Path, vocab_size: int, n: int = 4, length: int = 24) -> torch.Tensor:
    """Token ids of a few prompts: the tokenizer's encoding of fixed sentences if one is shipped, else seeded ids."""
    texts = ["The capital of France is", "12 + 35 =", "def fibonacci(n):", "Once upon a time"][:n]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(directory)
        ids = [tok(t)["input_ids"][:length] for t in texts]
        width = min(len(i) for i in ids)
        if width >= 2 and max(max(i) for i in ids) < vocab_size:
            return torch.tensor([i[:width] for i in ids])
    except Exception:  # noqa: BLE001 - no tokenizer shipped: fall back to ids
        pass
    return torch.randint(0, vocab_size, (n, length), generator=torch.Generator().manual_seed(1234))


def compare_logits(
    fp8_dir: str | Path, bf16_dir: str | Path, report: Report | None = None, prompts: torch.Tensor | None = None
) -> dict:
    """Logits of the FP8 checkpoint (transformers FineGrainedFP8, dequantized) vs the BF16 checkpoint.

    Two numbers and two criteria:
    * `exact_vs_dequantized_bf16`: the BF16 model with each FP8 linear's weight replaced by
      bf16(q * s) from the checkpoint must give the FP8 model's logits bit for bit -- the loader's
      dequantization is exactly the checkpoint's blocks (same program, same weights).
    * `rel_l2` of FP8 vs BF16 logits must stay below `bound = 2 * sqrt(sum_l eps_l^2)`, eps_l the
      measured relative Frobenius quantization error of linear l: to first order each linear's error
      enters the logits as an independent perturbation of relative size eps_l (errors of different
      linears are uncorrelated, so they add in quadrature); the factor 2 allows for gains between a
      linear and the logits. Requires `report` with per-tensor errors against the same BF16 reference.
    """
    fp8_dir, bf16_dir = Path(fp8_dir), Path(bf16_dir)
    m8 = _load_transformers(fp8_dir, True)
    mb = _load_transformers(bf16_dir, False)
    ids = prompts if prompts is not None else default_prompts(fp8_dir, m8.config.vocab_size)
    with torch.no_grad():
        a = m8(ids).logits.float()
        b = mb(ids).logits.float()
        ckpt = HFCheckpoint(fp8_dir)
        for name in ckpt.weight_map:
            if name.endswith("weight_scale_inv"):
                w = name.removesuffix("_scale_inv")
                dq = dequantize_blockwise(ckpt.get(w), ckpt.get(name), (128, 128)).to(torch.bfloat16)
                mb.get_parameter(w).data.copy_(dq)
        c = mb(ids).logits.float()
    rel = float((a - b).norm() / b.norm())
    out = {
        "prompts": list(ids.shape),
        "max_abs_diff": float((a - b).abs().max()),
        "rel_l2": rel,
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "exact_vs_dequantized_bf16": bool(torch.equal(a, c)),
    }
    if report is not None and report.tensors:
        out["bound"] = 2.0 * math.sqrt(sum(t["rel_err"] ** 2 for t in report.tensors))
        out["within_bound"] = rel <= out["bound"]
    return out
