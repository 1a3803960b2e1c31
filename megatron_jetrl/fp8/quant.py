"""Reference blockwise E4M3 quantizer: the bytes every other kernel must reproduce.

The formula and its provenance are in the package docstring (`megatron_jetrl.fp8`). This module is
plain torch, so it runs on any device; the Triton kernels in `megatron_jetrl.fp8.kernels` are checked
byte for byte against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-10
UE8M0_FLOOR = 1e-10
SCALE_MODES = ("fp32", "ue8m0")
BLOCKS = ((1, 128), (128, 1), (128, 128))
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class NonFiniteInputError(ValueError):
    """A tensor handed to the FP8 quantizer holds NaN or +-inf."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(block) -> tuple[int, int]:
    block = tuple(block)
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} (1x128 groups, 128x1 groups, 128x128 tiles), got {block}")
    return block


def scale_shape(shape, block) -> tuple[int, ...]:
    """Shape of the FP32 scale tensor for a tensor of `shape` quantized in `block`s (ceil-division)."""
    bm, bk = _check_block(block)
    shape = tuple(shape)
    if len(shape) == 1 and bm == 1:
        return (_cdiv(shape[0], bk),)
    if len(shape) < 2:
        raise ValueError(f"block {block} needs a tensor of at least 2 dims, got shape {shape}")
    return shape[:-2] + (_cdiv(shape[-2], bm), _cdiv(shape[-1], bk))


def ue8m0_round_up(s: torch.Tensor) -> torch.Tensor:
    """Round positive FP32 scales up to a power of two, exactly (bump the exponent if any mantissa bit is set)."""
    s = s.clamp_min(UE8M0_FLOOR)
    bits = s.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    rounded = (exponent << 23).view(torch.float32)
    return torch.where(torch.isfinite(s), rounded, s)  # keep NaN/inf poison visible


def _raise_non_finite(x: torch.Tensor, block) -> None:
    bad = (~torch.isfinite(x)).nonzero()
    where = tuple(int(i) for i in bad[0])
    value = x[where].item()
    raise NonFiniteInputError(
        f"FP8 quantization ({block[0]}x{block[1]} blocks) got {value} at index {where} of a tensor of shape "
        f"{tuple(x.shape)} ({bad.shape[0]} non-finite element(s) in all). E4M3 has no inf and torch would "
        "silently turn inf into 448; find where the NaN/inf is produced upstream (loss scale, learning rate, "
        "overflowing activations or bad data) instead of quantizing it."
    )


def quantize_blockwise(
    x: torch.Tensor,
    block,
    scale_mode: str = "fp32",
    *,
    eps: float = EPS,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to E4M3 with one FP32 dequant scale per group/block.

    Returns `(q, s)`: `q` is `float8_e4m3fn` of `x.shape`; `s` is float32 of `scale_shape(x.shape, block)`.
    Blocks act on the last two dims (the last dim alone for a 1-D tensor with block (1, 128)); leading
    dims are batch. Partial blocks at the edges get their own scale.
    """
    bm, bk = _check_block(block)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"quantize_blockwise takes {', '.join(map(str, INPUT_DTYPES))}, got {x.dtype}: "
            "cast explicitly (e.g. x.float()) so that any rounding before quantization is yours"
        )
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if not (isinstance(eps, float) and 0 < eps < 1e-3):
        raise ValueError(f"eps must be a small positive float (the amax floor; vLLM uses 1e-10), got {eps!r}")
    s_shape = scale_shape(x.shape, block)
    x3 = x.reshape(1, 1, -1) if x.dim() == 1 else x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    batch, m, k = x3.shape
    mb, kb = _cdiv(m, bm), _cdiv(k, bk)
    x32 = x3.to(torch.float32)
    if mb * bm != m or kb * bk != k:
        x32 = F.pad(x32, (0, kb * bk - k, 0, mb * bm - m))
    tiles = x32.view(batch, mb, bm, kb, bk)

    amax = tiles.abs().amax(dim=(2, 4))
    if check_finite and not bool(torch.isfinite(amax).all()):
        _raise_non_finite(x, block)
    fp8_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
    s = torch.clamp(amax, min=eps) / fp8_max  # tensor / tensor: a true division on every device
    if scale_mode == "ue8m0":
        s = ue8m0_round_up(s)
    q = torch.clamp(tiles / s[:, :, None, :, None], -E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.view(batch, mb * bm, kb * bk)[:, :m, :k]
    return q.reshape(x.shape), s.reshape(s_shape)


def dequantize_blockwise(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """`q * s` per group/block, in FP32 (the product is rounded once to FP32)."""
    bm, bk = _check_block(block)
    if q.dtype != E4M3:
        raise TypeError(f"dequantize_blockwise expects float8_e4m3fn data, got {q.dtype}")
    if s.dtype != torch.float32:
        raise TypeError(f"dequantize_blockwise expects float32 scales, got {s.dtype}")
    expected = scale_shape(q.shape, block)
    if tuple(s.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(s.shape)} does not match data {tuple(q.shape)} in {block} blocks: expected {expected}"
        )
    if q.dim() == 1:
        return q.to(torch.float32) * s.repeat_interleave(bk)[: q.shape[0]]
    m, k = q.shape[-2:]
    full = s.repeat_interleave(bm, dim=-2)[..., :m, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.to(torch.float32) * full


def wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` as a collective carries it: an FP8 tensor's bytes (a uint8 view: gloo sends no FP8 dtype, and bytes are what
    the contract keeps), any other tensor itself. `received.view(dtype)` is the tensor again."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def aligned_tp_sizes(size: int, block: int = 128, candidates=(1, 2, 4, 8, 16, 32, 64)) -> list[int]:
    """TP sizes that split `size` into equal shards of whole blocks."""
    return [tp for tp in candidates if size % tp == 0 and (size // tp) % block == 0]


def check_shard_alignment(size: int, parts: int, *, what: str, block: int = 128) -> None:
    """Refuse a split of a dimension of `size` into `parts` shards that would cut through a 128 block.

    A 128x128 weight block that straddles a TP shard boundary would be quantized differently by the
    trainer and by a rollout engine with another TP, so `quantize(shard(W)) == shard(quantize(W))`
    holds only for block-aligned shards.
    """
    if parts < 1:
        raise ValueError(f"{what}: the number of shards must be >= 1, got {parts}")
    if size % parts == 0 and (size // parts) % block == 0:
        return
    fits = aligned_tp_sizes(size, block)
    raise ValueError(
        f"{what}: a dimension of {size} split {parts} ways gives shards of {size / parts:g}, "
        f"not a multiple of the {block}-wide FP8 block; "
        + (
            f"TP sizes that keep whole blocks: {fits}"
            if fits
            else f"no TP size keeps whole blocks ({size} % {block} = {size % block})"
        )
    )


__all__ = [
    "BLOCKS",
    "E4M3",
    "E4M3_MAX",
    "EPS",
    "NonFiniteInputError",
    "aligned_tp_sizes",
    "check_shard_alignment",
    "dequantize_blockwise",
    "quantize_blockwise",
    "scale_shape",
    "ue8m0_round_up",
]
