"""Blockwise FP8 GEMM backends behind one dispatch.

`blockwise_gemm(a, b)` computes `dequant(a) @ dequant(b)^T` for
    a: [M, K] E4M3 with (1, 128) scales [M, ceil(K/128)]
    b: [N, K] E4M3 with (128, 128) scales [ceil(N/128), ceil(K/128)]  (FProp, DGrad)
                 or (1, 128) scales   [N, ceil(K/128)]               (WGrad: both reduced over tokens)
The operands are identical for every backend; backends differ only in accumulation order.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from megatron_jetrl.fp8.quant import E4M3, scale_shape

BACKENDS = ("auto", "emulated", "cublaslt", "deepgemm", "triton")
B_BLOCKS = ((128, 128), (1, 128))


def _check_operands(a_q, a_s, b_q, b_s, b_block) -> None:
    if b_block not in B_BLOCKS:
        raise ValueError(f"b_block must be one of {B_BLOCKS}, got {b_block}")
    if a_q.dtype != E4M3 or b_q.dtype != E4M3:
        raise TypeError(f"blockwise_gemm takes float8_e4m3fn operands, got {a_q.dtype} and {b_q.dtype}")
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"blockwise_gemm computes a[M, K] @ b[N, K]^T; got a {tuple(a_q.shape)}, b {tuple(b_q.shape)}")
    if tuple(a_s.shape) != scale_shape(a_q.shape, (1, 128)):
        raise ValueError(f"a's 1x128 scales must be {scale_shape(a_q.shape, (1, 128))}, got {tuple(a_s.shape)}")
    if tuple(b_s.shape) != scale_shape(b_q.shape, b_block):
        raise ValueError(f"b's {b_block} scales must be {scale_shape(b_q.shape, b_block)}, got {tuple(b_s.shape)}")


def _gemm_emulated(a_q, a_s, b_q, b_s, b_block, out_dtype):
    """Exact per-block products in FP64, scaled and summed over K blocks in ascending order.

    Each block product sums 128 products of two E4M3 values (multiples of 2**-18 below 2**18), so it
    needs at most 43 significant bits and is exact in FP64 whatever the matmul's internal order. The
    result for a row depends on that row only (batch invariant) and is the same on every device.
    """
    m, k = a_q.shape
    n = b_q.shape[0]
    a = a_q.to(torch.float64)
    b = b_q.to(torch.float64)
    sa = a_s.to(torch.float64)
    sb = b_s.to(torch.float64)
    if b_block == (128, 128):
        sb = sb.repeat_interleave(128, dim=0)[:n]
    out = torch.zeros(m, n, dtype=torch.float64, device=a_q.device)
    for kb in range(sa.shape[1]):
        cols = slice(kb * 128, min(k, (kb + 1) * 128))
        block = a[:, cols] @ b[:, cols].T
        out += block * (sa[:, kb, None] * sb[None, :, kb])
    return out.to(out_dtype)


@functools.cache
def _has_deep_gemm() -> bool:
    return importlib.util.find_spec("deep_gemm") is not None


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on `device`, fastest first (what `auto` picks is the first)."""
    device = torch.device(device)
    found = []
    if _is_sm90(device):
        if _has_deep_gemm():
            found.append("deepgemm")
        if hasattr(torch.nn.functional, "scaled_mm"):  # torch >= 2.10: blockwise scales with checked layouts
            found.append("cublaslt")
    if device.type == "cuda":
        from megatron_jetrl.fp8.kernels import supported

        if supported(device):  # Triton blockwise GEMM: portable fallback on any sm89+ GPU
            found.append("triton")
    found.append("emulated")
    return found


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown FP8 GEMM backend {name!r}; choose one of {BACKENDS}")
    have = available_backends(device)
    if name == "auto":
        return have[0]
    if name not in have:
        raise RuntimeError(f"FP8 GEMM backend {name!r} is not available on {device}; available here: {have}")
    return name


def blockwise_gemm(a_q, a_s, b_q, b_s, *, b_block=(128, 128), out_dtype=torch.bfloat16, backend="auto"):
    """`dequant(a) @ dequant(b)^T` in `out_dtype` on the chosen backend (see module docstring)."""
    b_block = tuple(b_block)
    _check_operands(a_q, a_s, b_q, b_s, b_block)
    name = resolve_backend(backend, a_q.device)
    if name == "emulated":
        return _gemm_emulated(a_q, a_s, b_q, b_s, b_block, out_dtype)
    if name == "triton":
        from megatron_jetrl.fp8.kernels import gemm

        return gemm(a_q, a_s, b_q, b_s, b_block, out_dtype)
    if name == "cublaslt":
        from megatron_jetrl.fp8.backends import gemm_cublaslt

        return gemm_cublaslt(a_q, a_s, b_q, b_s, b_block, out_dtype)
    from megatron_jetrl.fp8.backends import gemm_deepgemm

    return gemm_deepgemm(a_q, a_s, b_q, b_s, b_block, out_dtype)
