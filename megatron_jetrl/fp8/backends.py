"""Hopper GEMM backends for `megatron_jetrl.fp8.gemm.blockwise_gemm`: cuBLASLt (through torch) and DeepGEMM.

Both want K-major operands ([M, K] and [N, K] row-major) whose K is a whole number of 128-blocks.
A partial last K block is padded with zero bytes, which is exact: a zero contributes nothing to any
dot product and leaves the scales (computed over the real elements) untouched.

cuBLASLt through `torch.nn.functional.scaled_mm` (torch >= 2.10), scale layouts as torch's
`ScaledBlas.cpp` checks them (pytorch commit 0174dfab):
    A 1x128    [M, K/128]      strides (1, M)    (outer-dim-major)
    B 128x128  [L4, N/128]     strides (1, L4)   L4 = round_up(K/128, 4): cuBLASLt takes no leading
                                                dimension for block scales and reads this pitch, which
                                                is why an unpadded transposed view with K/128 = 5 gave
                                                silently wrong results through `torch._scaled_mm`
    B 1x128    [N, K/128]      strides (1, N)
The old `torch._scaled_mm` entry point is not used for blockwise scales for that reason, and the first
use in a process checks the backend against the emulated reference on a K/128 = 5 shape.

DeepGEMM (deepseek-ai/DeepGEMM @0274ad7b, `fp8_gemm_nt`; not installable here, so written against its
source and never run by our CI): FP32 scales on sm90; FProp/DGrad recipe (1, 128, 128) with BF16 output;
WGrad recipe (1, 1, 128) needs an FP32 output and accumulator `c`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _pad_k(q: torch.Tensor) -> torch.Tensor:
    """Row-major copy of an [R, K] E4M3 operand with K padded by zero bytes to a multiple of 128."""
    k = q.shape[1]
    pad = -k % 128
    if pad == 0 and q.is_contiguous():
        return q
    out = torch.zeros(q.shape[0], k + pad, dtype=q.dtype, device=q.device)
    out[:, :k] = q
    return out


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """[R, L] scales stored column-major: strides (1, R)."""
    return s.t().contiguous().t()


def _block_scales_l4(s: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] block scales -> [L4, N/128] view with strides (1, L4), K-blocks padded to 4."""
    nb, kb = s.shape
    if kb % 4 == 0 and s.is_contiguous():  # already that layout (K = 512 * j): no copy per GEMM
        return s.t()
    padded = torch.zeros(nb, -(-kb // 4) * 4, dtype=s.dtype, device=s.device)
    padded[:, :kb] = s
    return padded.t()


def gemm_cublaslt(a_q, a_s, b_q, b_s, b_block, out_dtype):
    _self_test_cublaslt(a_q.device)
    return _cublaslt(a_q, a_s, b_q, b_s, b_block, out_dtype)


M_ALIGN = 16
"""cuBLASLt's heuristic answers CUBLAS_STATUS_NOT_SUPPORTED for a blockwise product (1x128 A scales) whose M is
not a multiple of 4: on the H200 with torch 2.11.0+cu130, M = 2, 3, 5, 17, 61, 125, 127, 1001 were refused and
M = 4, 8, 12, 16, 24, 64, 100, 120, 128, 1000 ran (K 1536/8960, N 256/1536/8960); M = 1 is refused earlier by
torch's scale-stride check. A native-engine decode step hits this once some rows have stopped. `_cublaslt` pads
M to a multiple of 16 with zero rows (zero bytes and zero scales: those rows come out zero and are cut off; the
real rows are unchanged); the padded path matched the emulated GEMM (relative error 1.2-1.4e-4) at every M above."""


def _pad_m(a: torch.Tensor, a_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = a.shape[0]
    pad = -m % M_ALIGN
    if pad == 0:
        return a, a_s
    a_pad = torch.zeros(m + pad, a.shape[1], dtype=a.dtype, device=a.device)
    a_pad[:m] = a
    s_pad = torch.zeros(m + pad, a_s.shape[1], dtype=a_s.dtype, device=a_s.device)
    s_pad[:m] = a_s
    return a_pad, s_pad


def _cublaslt(a_q, a_s, b_q, b_s, b_block, out_dtype):
    from torch.nn.functional import ScalingType

    m = a_q.shape[0]
    a, b = _pad_k(a_q), _pad_k(b_q)
    a, a_s = _pad_m(a, a_s)
    if b_block == (128, 128):
        scale_b, recipe_b = _block_scales_l4(b_s), ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = _outer_major(b_s), ScalingType.BlockWise1x128
    out = F.scaled_mm(
        a, b.t(), _outer_major(a_s), ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype
    )
    return out if out.shape[0] == m else out[:m]


@functools.cache
def _self_test_cublaslt(device: torch.device) -> None:
    """Refuse cuBLASLt if it is wrong on a K/128 = 5, N/128 = 2 product (the stride trap)."""
    from megatron_jetrl.fp8.gemm import _gemm_emulated
    from megatron_jetrl.fp8.quant import quantize_blockwise

    g = torch.Generator(device=device).manual_seed(0)
    for m, b_block in ((64, (128, 128)), (64, (1, 128)), (61, (128, 128))):  # 61: the M padding (_pad_m)
        a_q, a_s = quantize_blockwise(torch.randn(m, 640, device=device, generator=g), (1, 128))
        b_q, b_s = quantize_blockwise(torch.randn(256, 640, device=device, generator=g), b_block)
        want = _gemm_emulated(a_q, a_s, b_q, b_s, b_block, torch.float32)
        got = _cublaslt(a_q, a_s, b_q, b_s, b_block, torch.float32)
        err = ((got - want).norm() / want.norm()).item()
        if not err < 1e-3:
            raise RuntimeError(
                f"cuBLASLt blockwise FP8 GEMM ({b_block} B scales) is wrong on this torch/cuBLAS "
                f"(relative error {err:.3g} at M={m}, K/128=5): use backend='emulated' or 'triton', and report the torch version"
            )


def gemm_deepgemm(a_q, a_s, b_q, b_s, b_block, out_dtype):
    import deep_gemm

    a, b = _pad_k(a_q), _pad_k(b_q)
    m, n = a.shape[0], b.shape[0]
    if b_block == (128, 128):
        d = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        deep_gemm.fp8_gemm_nt((a, a_s.contiguous()), (b, b_s.contiguous()), d, disable_ue8m0_cast=True)
        return d if out_dtype == torch.bfloat16 else d.to(out_dtype)
    d = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    deep_gemm.fp8_gemm_nt((a, a_s.contiguous()), (b, b_s.contiguous()), d, c=d, recipe=(1, 1, 128), disable_ue8m0_cast=True)
    return d if out_dtype == torch.float32 else d.to(out_dtype)
