"""The blockwise FP8 GEMM backends; `megatron_jetrl.fp8.gemm` picks one (this module imports none of its callers).

Every backend computes `dequant(a) @ dequant(b)^T` from the same operands (see `gemm.blockwise_gemm`) and
differs only in accumulation order. Each returns a new tensor in `out_dtype`, or adds its FP32 result
into `acc` (an FP32 [M, N] buffer such as megatron's `main_grad`) and returns `acc`.

emulated   any device: exact per-block products in FP64 (the reference).
cublaslt   torch `F.scaled_mm` (torch >= 2.10, sm90). Scale layouts as torch's `ScaledBlas.cpp` checks them
           (pytorch commit 0174dfab):
               A 1x128    [M, K/128]      strides (1, M)    (outer-dim-major)
               B 128x128  [L4, N/128]     strides (1, L4)   L4 = round_up(K/128, 4): cuBLASLt takes no leading
                                                            dimension for block scales and reads this pitch,
                                                            why an unpadded transposed view with K/128 = 5 gave
                                                            silently wrong results through `torch._scaled_mm`
               B 1x128    [N, K/128]      strides (1, N)
deepgemm   DeepGEMM's `fp8_gemm_nt` (2.5.0 as bundled in vLLM 0.26 as `vllm.third_party.deep_gemm`, or a
           `deep_gemm` install; read in deepseek-ai/DeepGEMM@54e22612 csrc/apis/gemm.hpp + layout.hpp):
               FProp/DGrad  1D2D kernel, recipe (1, 128, 128): BF16 output, no accumulator. A's 1x128
                            scales MN-major with a 16-byte-aligned pitch -- the (1, M) layout our Triton
                            quantizers write, used as is when M % 4 == 0 (DeepGEMM re-lays others out);
                            B's 128x128 scales contiguous or a transposed view of contiguous (DGrad's W^T).
               WGrad        1D1D kernel, recipe (1, 1, 128): FP32 output that must be its own accumulator
                            (`c = d`), so the product lands in `acc` (the parameter's `main_grad`) with
                            no zeros buffer and no cast. K (tokens) is compiled as a runtime dim
                            (`compiled_dims="mn"`), so variable micro-batch lengths JIT no new kernels.
triton     `megatron_jetrl.fp8.kernels.gemm` (any sm89+ GPU; the portable fallback); with `acc` its store adds
           the FP32 product into it (no separate buffer or add).

Operands must be K-major ([M, K], [N, K] row-major). cuBLASLt and DeepGEMM want K a whole number of
128-blocks: a partial last K block is padded with zero bytes, which is exact (a zero adds nothing and the
scales, taken over the real elements, are unchanged). cuBLASLt and DeepGEMM are checked against the
emulated reference at first use in a process, on shapes that hit their layout traps.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F


def gemm_emulated(a_q, a_s, b_q, b_s, b_block, out_dtype, acc=None):
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
    return _deliver(out, out_dtype, acc)


def _deliver(out, out_dtype, acc):
    if acc is None:
        return out.to(out_dtype)
    return acc.add_(out.to(torch.float32))


def _pad_k(q: torch.Tensor) -> torch.Tensor:
    """Row-major copy of an [R, K] E4M3 operand with K padded by zero bytes to a multiple of 128."""
    k = q.shape[1]
    pad = -k % 128
    if pad == 0 and q.is_contiguous():
        return q
    out = torch.zeros(q.shape[0], k + pad, dtype=q.dtype, device=q.device)
    out[:, :k] = q
    return out


# ---- cuBLASLt ---------------------------------------------------------------------------------------


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """[R, L] scales stored column-major: strides (1, R) (no copy when they already are)."""
    if s.stride(0) == 1 and (s.shape[1] == 1 or s.stride(1) == s.shape[0]):
        return s
    return s.t().contiguous().t()


def _block_scales_l4(s: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] block scales -> [L4, N/128] view with strides (1, L4), K-blocks padded to 4."""
    nb, kb = s.shape
    if kb % 4 == 0 and s.is_contiguous():  # already that layout (K = 512 * j): no copy per GEMM
        return s.t()
    padded = torch.zeros(nb, -(-kb // 4) * 4, dtype=s.dtype, device=s.device)
    padded[:, :kb] = s
    return padded.t()


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


def gemm_cublaslt(a_q, a_s, b_q, b_s, b_block, out_dtype, acc=None):
    from torch.nn.functional import ScalingType

    m = a_q.shape[0]
    a, b = _pad_k(a_q), _pad_k(b_q)
    a, a_s = _pad_m(a, a_s)
    if b_block == (128, 128):
        scale_b, recipe_b = _block_scales_l4(b_s), ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = _outer_major(b_s), ScalingType.BlockWise1x128
    dtype = torch.float32 if acc is not None else out_dtype
    out = F.scaled_mm(a, b.t(), _outer_major(a_s), ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=dtype)
    out = out if out.shape[0] == m else out[:m]
    return out if acc is None else acc.add_(out)


# ---- DeepGEMM ---------------------------------------------------------------------------------------

DEEP_GEMM_MODULES = ("deep_gemm", "vllm.third_party.deep_gemm")


@functools.cache
def deep_gemm_module():
    """The first of `DEEP_GEMM_MODULES` that imports with an `fp8_gemm_nt`, or None."""
    for name in DEEP_GEMM_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: not usable here
            continue
        if hasattr(module, "fp8_gemm_nt"):
            return module
    return None


SMS_IN_USE = [0]
"""The SM count last given to DeepGEMM's `set_num_sms` in this process (0: its own default, all of the device's)."""


def limit_sms(n: int, device: torch.device) -> None:
    """DeepGEMM's kernels use `n` SMs of `device` from now on, in this process (0: all of them): `PrecisionFlow.gemm_sms`."""
    dg = deep_gemm_module()
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if n > total:
        raise ValueError(
            f"precision.gemm_sms={n}, but {torch.cuda.get_device_name(device)} has {total} SMs: give at most "
            f"{total} (0: all of them)"
        )
    if not hasattr(dg, "set_num_sms"):
        raise RuntimeError(
            f"precision.gemm_sms={n}: this DeepGEMM ({dg.__name__}) has no set_num_sms; use DeepGEMM 2.x "
            "(vLLM 0.26 bundles 2.5.0) or leave gemm_sms at 0"
        )
    dg.set_num_sms(n or total)
    SMS_IN_USE[0] = n


def deepgemm_takes(n: int) -> bool:
    """DeepGEMM stores D with TMA: its rows must be 16-byte aligned, N % 8 == 0 for BF16 (every model linear,
    all of whose dims are multiples of 128; `auto` passes other shapes to the next backend)."""
    return n % 8 == 0


def gemm_deepgemm(a_q, a_s, b_q, b_s, b_block, out_dtype, acc=None):
    if not deepgemm_takes(b_q.shape[0]):
        raise ValueError(
            f"DeepGEMM needs N % 8 == 0 (a TMA store of the output rows), got N={b_q.shape[0]}: "
            "use backend='auto' (which passes such shapes on), 'cublaslt' or 'triton'"
        )
    dg = deep_gemm_module()
    a, b = _pad_k(a_q), _pad_k(b_q)
    m, n = a.shape[0], b.shape[0]
    if b_block == (128, 128):  # 1D2D: BF16 out, no accumulator
        d = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        dg.fp8_gemm_nt((a, a_s), (b, b_s), d, disable_ue8m0_cast=True)
        if acc is not None:
            return acc.add_(d)
        return d if out_dtype == torch.bfloat16 else d.to(out_dtype)
    d = acc if acc is not None else torch.zeros(m, n, dtype=torch.float32, device=a.device)
    dg.fp8_gemm_nt((a, a_s), (b, b_s), d, c=d, recipe=(1, 1, 128), compiled_dims="mn", disable_ue8m0_cast=True)
    return d if acc is not None or out_dtype == torch.float32 else d.to(out_dtype)


def gemm_triton(a_q, a_s, b_q, b_s, b_block, out_dtype, acc=None):
    from megatron_jetrl.fp8.kernels import gemm

    if acc is not None:
        return gemm(a_q, a_s, b_q, b_s, b_block, torch.float32, out=acc, accumulate=True)
    return gemm(a_q, a_s, b_q, b_s, b_block, out_dtype)


# ---- first-use checks ---------------------------------------------------------------------------------

GEMMS = {"emulated": gemm_emulated, "cublaslt": gemm_cublaslt, "deepgemm": gemm_deepgemm, "triton": gemm_triton}
SELF_TEST_BOUND = {"cublaslt": 1e-3, "deepgemm": 1e-2}
"""Relative error allowed against the emulated reference; DeepGEMM's 1D2D output is BF16 (~2**-9 per element)."""


@functools.cache
def self_test(name: str, device: torch.device) -> None:
    """Refuse backend `name` if it is wrong on shapes that hit the layout traps: K/128 = 5 (the cuBLASLt
    scale-pitch trap), M = 61 (padding / scale re-layout), N/128 = 2, both B scale kinds, accumulation."""
    from megatron_jetrl.fp8.quant import quantize_blockwise

    g = torch.Generator(device=device).manual_seed(0)
    for m, b_block, accumulate in ((64, (128, 128), False), (64, (1, 128), False), (61, (128, 128), False), (64, (1, 128), True)):
        a_q, a_s = quantize_blockwise(torch.randn(m, 640, device=device, generator=g), (1, 128))
        b_q, b_s = quantize_blockwise(torch.randn(256, 640, device=device, generator=g), b_block)
        want = gemm_emulated(a_q, a_s, b_q, b_s, b_block, torch.float32)
        if accumulate:
            start = torch.randn(m, 256, device=device, generator=g)
            want += start
            got = GEMMS[name](a_q, a_s, b_q, b_s, b_block, torch.float32, acc=start.clone())
        else:
            got = GEMMS[name](a_q, a_s, b_q, b_s, b_block, torch.float32)
        err = ((got.float() - want).norm() / want.norm()).item()
        if not err < SELF_TEST_BOUND[name]:
            raise RuntimeError(
                f"the {name} blockwise FP8 GEMM ({b_block} B scales{', accumulating' if accumulate else ''}) is wrong on this "
                f"machine (relative error {err:.3g} against the emulated reference at M={m}, K/128=5): use backend='triton' "
                "or 'emulated', and report the torch / DeepGEMM version"
            )
