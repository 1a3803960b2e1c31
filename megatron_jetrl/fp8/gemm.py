"""Blockwise FP8 GEMM: the one place that decides which backend runs (implementations: `fp8.backends`).

`blockwise_gemm(a, b)` computes `dequant(a) @ dequant(b)^T` for
    a: [M, K] E4M3 with (1, 128) scales [M, ceil(K/128)]
    b: [N, K] E4M3 with (128, 128) scales [ceil(N/128), ceil(K/128)]  (FProp, DGrad)
                 or (1, 128) scales   [N, ceil(K/128)]               (WGrad: both reduced over tokens)
The operands are identical for every backend; backends differ only in accumulation order. With `acc`
(an FP32 [M, N] buffer: megatron's `main_grad`) the FP32 product is added into it -- on DeepGEMM inside
the WGrad kernel itself -- and `acc` is returned.
"""

from __future__ import annotations

import functools
import math

import torch

from megatron_jetrl.fp8 import backends
from megatron_jetrl.fp8.backends import gemm_emulated
from megatron_jetrl.fp8.quant import E4M3, scale_shape

BACKENDS = ("auto", "emulated", "cublaslt", "deepgemm", "triton")
B_BLOCKS = ((128, 128), (1, 128))
CHECKED_AT_FIRST_USE = ("cublaslt", "deepgemm")
K_BLOCK = 128
"""cuBLASLt's and DeepGEMM's K granularity: a K that is not a whole number of blocks is padded by a zero-filled copy of
both operands (`backends._pad_k`). WGrad's K is the micro-batch's tokens."""


def token_multiple(micro_batch_size: int, shards: int = 1) -> int:
    """The sequence-length multiple at which a micro-batch's tokens (`micro_batch_size` x length) are whole K blocks:
    WGrad then reads its operands as the quantizers wrote them, and the backward's token-grouped quantizers (16-token
    chunks, `cuda_tiles.takes`) stay on their CUDA tile kernel. With `shards` (the TP size under sequence parallelism)
    the length also splits into that many equal parts of whole K blocks each, so that each rank can quantize its own
    128-token groups before they are gathered."""
    blocks = K_BLOCK * shards
    return math.lcm(blocks // math.gcd(micro_batch_size, blocks), shards)


def _check_operands(a_q, a_s, b_q, b_s, b_block, acc) -> None:
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
    if acc is not None:
        _check_acc(acc, a_q.shape[0], b_q.shape[0])


def _check_acc(acc, m: int, n: int) -> None:
    if acc.dtype != torch.float32 or acc.shape != (m, n) or not acc.is_contiguous():
        raise ValueError(
            f"acc must be a contiguous FP32 [{m}, {n}] buffer (megatron DDP's main_grad needs "
            f"grad_reduce_in_fp32), got {acc.dtype} {tuple(acc.shape)}{'' if acc.is_contiguous() else ' (not contiguous)'}"
        )


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on `device`, fastest first (what `auto` picks is the first).

    On Hopper: DeepGEMM when `deep_gemm` or vLLM's bundled copy imports (the fastest FP8 GEMM measured here:
    BENCHMARKS.md), then cuBLASLt (torch >= 2.10), then Triton; elsewhere Triton on
    any sm89+ GPU; the emulated reference everywhere.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return list(_available(device))


@functools.cache
def _available(device: torch.device) -> tuple[str, ...]:
    found = []
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        if backends.deep_gemm_module() is not None:
            found.append("deepgemm")
        if hasattr(torch.nn.functional, "scaled_mm"):  # torch >= 2.10: blockwise scales with checked layouts
            found.append("cublaslt")
    if device.type == "cuda":
        from megatron_jetrl.fp8.kernels import supported

        if supported(device):
            found.append("triton")
    found.append("emulated")
    return tuple(found)


@functools.cache
def resolve_backend(name: str, device: torch.device, n: int | None = None) -> str:
    """The backend `name` means on `device`; `auto` is the first available one that takes an output of `n` columns.
    Cached (it runs for every GEMM); a refusal is not cached and is raised again."""
    if name not in BACKENDS:
        raise ValueError(f"unknown FP8 GEMM backend {name!r}; choose one of {BACKENDS}")
    have = available_backends(device)
    if name == "auto":
        return next(b for b in have if b != "deepgemm" or n is None or backends.deepgemm_takes(n))
    if name not in have:
        raise RuntimeError(f"FP8 GEMM backend {name!r} is not available on {device}; available here: {have}")
    return name


def blockwise_gemm(
    a_q, a_s, b_q, b_s, *, b_block=(128, 128), out_dtype=torch.bfloat16, backend="auto", acc=None, checked=False, sms=None
):
    """`dequant(a) @ dequant(b)^T` in `out_dtype` on the chosen backend, or added into `acc` (see module docstring).

    `checked=True`: the caller vouches for the operands (the FP8 linear passes what this package's quantizers made,
    `b_block` a tuple), so only `acc`, which comes from outside (megatron's `main_grad`), is checked on the hot path.
    `sms` (the flow's `gemm_sms`; None: as it is): the SMs DeepGEMM's kernels use from this call on, in this process."""
    if not checked:
        b_block = tuple(b_block)
        _check_operands(a_q, a_s, b_q, b_s, b_block, acc)
    elif acc is not None:
        _check_acc(acc, a_q.shape[0], b_q.shape[0])
    device = a_q.device
    name = resolve_backend(backend, device, b_q.shape[0])
    if name in CHECKED_AT_FIRST_USE:
        backends.self_test(name, device)
        if name == "deepgemm" and sms is not None and sms != backends.SMS_IN_USE[0]:
            backends.limit_sms(sms, device)
    return backends.GEMMS[name](a_q, a_s, b_q, b_s, b_block, out_dtype, acc)


__all__ = ["BACKENDS", "available_backends", "blockwise_gemm", "gemm_emulated", "resolve_backend"]
