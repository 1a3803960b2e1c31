"""Triton kernels for the FP8 flow on CUDA: blockwise quantizers and blockwise GEMMs.

Every quantizer here reproduces the bytes of the reference `megatron_jetrl.fp8.quant.quantize_blockwise`
(the contract is in the package docstring), which tests/gpu checks on random and adversarial inputs:

* amax over the group in FP32 (masked-out elements of a partial group read as 0, as the reference's
  zero padding), `s = max(amax, eps) / 448` and `x / s` as true IEEE divisions (`div.rn.f32` through
  inline PTX: Triton's `/` is an approximate division and libdevice's `div_rn` flushes subnormals),
  UE8M0 by exponent bumping, clamp to +-448 keeping NaN, `cvt.rn.satfinite` to E4M3 (round to nearest
  even). `x / s` is the IEEE quotient computed from one reciprocal per group, y = RN(1/s), as q = RN(x * y)
  plus Markstein FMA corrections (`quant_math`'s `divide`; one for BF16 values, two for wider ones:
  `division_steps`), as fp8/cuda_tiles.py does; tests/gpu checks it against `div.rn.f32` for every 24-bit
  scale significand. Eps below 2^-50 (scales under 2^-60) keeps the per-element division. A non-finite
  group gets a NaN/inf scale and NaN bytes; the Python wrappers raise `NonFiniteInputError` (the
  reference's message) when `check_finite` is on.

Kernels
-------
quantize_1x128(x)          1x128 groups along the last dim; scales written outer-dim-major (strides (1, M))
                           which is what cuBLASLt and the Triton GEMM read without a copy. BF16 input goes to the
                           CUDA tile kernel (`QUANT_CFG["1x128"]["mode"] = "cuda"`) where its layout allows.  Optional
                           SwiGLU prologue (`swiglu_quantize_1x128`): quantizes silu(gate) * up of a
                           [M, 2I] tensor without writing the BF16 product.
quantize_dual(x)           one pass over a [T, N] gradient: 1x128 (along N) bytes/scales and the 128x1
                           (along T) bytes/scales written *transposed*, [N, T] K-major, as WGrad wants.
                           Also takes E4M3 bytes + 1x128 scales (the saved activation): dequantizes in
                           FP32 (q * s, as `dequantize_blockwise`) and re-quantizes along tokens, with no
                           FP32/BF16 copy in memory.
                           On Hopper the default (`QUANT_CFG["dual"]["mode"] = "cuda"`) is the hand-laid-out CUDA
                           kernel of `fp8/cuda_tiles.py` wherever the layout allows its 16-byte accesses.
swiglu_backward(gu, dy)    d[gate | up] of silu(gate) * up (the FP8 down projection's input) in one pass, with the
                           roundings of torch's autograd of those ops (BF16, not part of the quantizer contract).
swiglu_backward_dual(gu, dy)  quantize_dual of that gradient; mode "cuda" computes and quantizes it in one CUDA tile
                           kernel (fp8/cuda_tiles.py), never storing it.
quantize_128x128(w)        weight tiles; optionally also the transposed copy (bytes of W^T, scales of
                           W^T: identical to quantizing W^T, since a 128x128 tile has one scale). BF16 weights go
                           to the CUDA tile kernel with one scale per tile where the layout allows.
gemm(a, sa, b, sb)         dequant(a) @ dequant(b)^T, a 1x128, b 128x128 or 1x128 (WGrad), both K-major.
                           Each 128-deep K block is one tensor-core product in FP32, scaled by
                           sa * sb and added to an FP32 accumulator (DeepSeek-style promotion).

Triton is imported lazily: the CPU package never needs it.
"""

from __future__ import annotations

import functools

import torch

from megatron_jetrl.fp8 import cuda_tiles
from megatron_jetrl.fp8.launch import Launcher
from megatron_jetrl.fp8.quant import (
    E4M3,
    EPS,
    INPUT_DTYPES,
    SCALE_MODES,
    _raise_non_finite,
    scale_shape,
)

GROUP = 128


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or broken on this machine: the torch path serves
        return False
    return True


def supported(device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA with FP8 tensor cores, sm89+, and Triton). Called per
    quantization: the answer is cached per device (a capability query costs host time on the hot path)."""
    device = torch.device(device)
    return device.type == "cuda" and _supported_cuda(device.index if device.index is not None else torch.cuda.current_device())


def tensor_supported(x: torch.Tensor) -> bool:
    """`supported(x.device)` without building a device object: it runs several times per FP8 linear."""
    return x.is_cuda and _supported_cuda(x.get_device())


@functools.cache
def _supported_cuda(index: int) -> bool:
    return torch.cuda.is_available() and triton_available() and torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def quant_math():
    """The quantizer's Triton functions `(div_rn, scale_of, to_e4m3, divide)`: the contract's FP32 steps, shared with the
    kernels that quantize what they produce (`actor.glue_kernels`' RMSNorm for vLLM's FP8 linears)."""
    import triton
    import triton.language as tl

    @triton.jit
    def div_rn(a, b):
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def scale_of(amax, has_nan, eps, UE8M0: tl.constexpr):
        """amax >= 0 (may be inf) -> dequant scale; NaN when the group had a NaN."""
        s = div_rn(tl.maximum(amax, eps), tl.zeros_like(amax) + 448.0)
        if UE8M0:
            s = tl.maximum(s, 1e-10)
            bits = s.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            r = (e << 23).to(tl.float32, bitcast=True)
            s = tl.where(((bits >> 23) & 0xFF) != 0xFF, r, s)  # inf/NaN stay visible
        return tl.where(has_nan, float("nan"), s)

    @triton.jit
    def divide(x, s, DIV: tl.constexpr = 0):
        """x / s (s broadcast over x's groups), the IEEE quotient. DIV (`division_steps`): 0, the IEEE division per
        element; 1 or 2, y = RN(1/s) per group, q = RN(x * y), then DIV Markstein corrections q += (x - s q) y."""
        if DIV == 0:
            v = div_rn(x, s)
        else:
            # The residual is formed negated, s q - x, and added times -y, so that x = -0 keeps its sign (-0 + -0;
            # x - s q would give +0). Negations are products with -1 (Triton's unary minus is 0 - x, which is +0
            # for x = +0); they fold into the FMAs' operands.
            y = div_rn(tl.full(s.shape, 1.0, tl.float32), s)
            sf = tl.where(y == 0.0, 0.0, s)  # s = inf: the residual term vanishes and v = x * 0, as x / inf
            ny = y * -1.0
            nx = x * -1.0
            v = x * y
            v = tl.fma(tl.fma(sf, v, nx), ny, v)
            if DIV == 2:
                v = tl.fma(tl.fma(sf, v, nx), ny, v)
        return v

    @triton.jit
    def to_e4m3(x, s, DIV: tl.constexpr = 0):
        """x / s (`divide`), clamped to +-448 with NaN kept, rounded to E4M3."""
        v = divide(x, s, DIV)
        c = tl.minimum(tl.maximum(v, -448.0), 448.0)
        c = tl.where(v != v, v, c)
        return c.to(tl.float8e4nv)

    return div_rn, scale_of, to_e4m3, divide


@functools.cache
def _k():
    """Build the kernels on first use (imports triton)."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    div_rn, scale_of, to_e4m3, _ = quant_math()

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _quant_1x128(
        x_ptr,
        q_ptr,
        s_ptr,
        M,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sk,
        eps,
        p_ptr,
        stride_pm,
        BLOCK_M: tl.constexpr,
        G: tl.constexpr,
        UE8M0: tl.constexpr,
        SWIGLU: tl.constexpr,
        EVEN: tl.constexpr,
        PRODUCT: tl.constexpr,
        DIV: tl.constexpr,
    ):
        # one program: BLOCK_M rows x G consecutive 128-groups; PRODUCT (with SWIGLU): the BF16 product is stored too
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pid_k * (G * 128) + tl.arange(0, G * 128)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        if SWIGLU:  # x holds [gate | up], each K wide; the product is rounded to x's dtype, as torch does
            if EVEN:
                g = tl.load(ptrs)
                u = tl.load(ptrs + K)
            else:
                g = tl.load(ptrs, mask=mask, other=0.0)
                u = tl.load(ptrs + K, mask=mask, other=0.0)
            g32 = g.to(tl.float32)
            act = div_rn(g32, 1.0 + libdevice.exp(g32 * -1.0)).to(g.dtype)  # torch: x / (1 + expf(-x)); * -1 folds
            prod = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
            if PRODUCT:
                p_ptrs = p_ptr + offs_m[:, None].to(tl.int64) * stride_pm + offs_k[None, :]
                if EVEN:
                    tl.store(p_ptrs, prod)
                else:
                    tl.store(p_ptrs, prod, mask=mask)
            x = prod.to(tl.float32)
        else:
            if EVEN:
                x = tl.load(ptrs).to(tl.float32)
            else:
                x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (BLOCK_M, G, 128))
        amax = tl.reduce(tl.abs(x3), 2, _max_nan)  # NaN when the group has one: one reduction answers both
        s = scale_of(amax, amax != amax, eps, UE8M0)  # [BLOCK_M, G]
        q = tl.reshape(to_e4m3(x3, s[:, :, None], DIV), (BLOCK_M, G * 128))
        q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :]
        offs_g = pid_k * G + tl.arange(0, G)
        s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_g[None, :] * stride_sk
        if EVEN:
            tl.store(q_ptrs, q)
            tl.store(s_ptrs, s)
        else:
            tl.store(q_ptrs, q, mask=mask)
            tl.store(s_ptrs, s, mask=(offs_m[:, None] < M) & (offs_g[None, :] * 128 < K))

    @triton.jit
    def _quant_cols(
        x_ptr,
        xs_ptr,
        qt_ptr,
        st_ptr,
        T,
        N,
        stride_xt,
        stride_xst,
        stride_xsn,
        stride_qtn,
        stride_stn,
        stride_stt,
        eps,
        BLOCK_N: tl.constexpr,
        FP8_IN: tl.constexpr,
        UE8M0: tl.constexpr,
        EVEN: tl.constexpr,
        TRANS: tl.constexpr,
        TMA: tl.constexpr,
    ):
        # 128x1 groups along T of a [128, BLOCK_N] tile, written transposed ([N, T], T contiguous). TMA: `qt_ptr` is a
        # tensor descriptor of qt and the transposed tile leaves through a TMA store (which clips partial tiles).
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_t = pid_t * 128 + tl.arange(0, 128)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_t[:, None] < T) & (offs_n[None, :] < N)
        ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_n[None, :]
        if EVEN:
            x = tl.load(ptrs).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if FP8_IN:
            xs = tl.load(
                xs_ptr + offs_t[:, None].to(tl.int64) * stride_xst + (offs_n[None, :] // 128) * stride_xsn,
                mask=mask,
                other=1.0,
            )
            x = x * xs
        amax = tl.max(tl.abs(x), axis=0)
        s = scale_of(amax, tl.max((x != x).to(tl.int32), axis=0) > 0, eps, UE8M0)
        q = to_e4m3(x, s[None, :])
        st_ptrs = st_ptr + offs_n.to(tl.int64) * stride_stn + pid_t * stride_stt
        if TMA:
            qt_ptr.store([pid_n * BLOCK_N, pid_t * 128], tl.trans(q))
        elif TRANS:
            qt_ptrs = qt_ptr + offs_n[:, None].to(tl.int64) * stride_qtn + offs_t[None, :]
            if EVEN:
                tl.store(qt_ptrs, tl.trans(q))
            else:
                tl.store(qt_ptrs, tl.trans(q), mask=(offs_n[:, None] < N) & (offs_t[None, :] < T))
        else:
            qt_ptrs = qt_ptr + offs_n[None, :].to(tl.int64) * stride_qtn + offs_t[:, None]
            if EVEN:
                tl.store(qt_ptrs, q)
            else:
                tl.store(qt_ptrs, q, mask=mask)
        if EVEN:
            tl.store(st_ptrs, s)
        else:
            tl.store(st_ptrs, s, mask=offs_n < N)

    @triton.jit
    def _quant_dual(
        x_ptr,
        xs_ptr,
        q_ptr,
        s_ptr,
        qt_ptr,
        st_ptr,
        T,
        N,
        stride_xt,
        stride_xst,
        stride_xsn,
        stride_qt,
        stride_st,
        stride_sn,
        stride_qtn,
        stride_stn,
        stride_stt,
        eps,
        FP8_IN: tl.constexpr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
        UE8M0: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_t = pid_t * 128 + tl.arange(0, 128)
        offs_n = pid_n * 128 + tl.arange(0, 128)
        mask = (offs_t[:, None] < T) & (offs_n[None, :] < N)
        ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_n[None, :]
        if EVEN:
            x = tl.load(ptrs).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if FP8_IN:  # dequantize the saved activation: q * s (1x128 along N), one FP32 rounding
            xs = tl.load(xs_ptr + offs_t.to(tl.int64) * stride_xst + pid_n * stride_xsn, mask=offs_t < T, other=1.0)
            x = x * xs[:, None]
        isnan = (x != x).to(tl.int32)
        if ROWS:
            amax_r = tl.max(tl.abs(x), axis=1)
            s_r = scale_of(amax_r, tl.max(isnan, axis=1) > 0, eps, UE8M0)
            q_r = to_e4m3(x, s_r[:, None])
            q_ptrs = q_ptr + offs_t[:, None].to(tl.int64) * stride_qt + offs_n[None, :]
            s_ptrs = s_ptr + offs_t.to(tl.int64) * stride_st + pid_n * stride_sn
            if EVEN:
                tl.store(q_ptrs, q_r)
                tl.store(s_ptrs, s_r)
            else:
                tl.store(q_ptrs, q_r, mask=mask)
                tl.store(s_ptrs, s_r, mask=offs_t < T)
        if COLS:
            amax_c = tl.max(tl.abs(x), axis=0)
            s_c = scale_of(amax_c, tl.max(isnan, axis=0) > 0, eps, UE8M0)
            q_c = tl.trans(to_e4m3(x, s_c[None, :]))  # [N-tile, T-tile]
            qt_ptrs = qt_ptr + offs_n[:, None].to(tl.int64) * stride_qtn + offs_t[None, :]
            st_ptrs = st_ptr + offs_n.to(tl.int64) * stride_stn + pid_t * stride_stt
            if EVEN:
                tl.store(qt_ptrs, q_c)
                tl.store(st_ptrs, s_c)
            else:
                tl.store(qt_ptrs, q_c, mask=(offs_n[:, None] < N) & (offs_t[None, :] < T))
                tl.store(st_ptrs, s_c, mask=offs_n < N)

    @triton.jit
    def _quant_128x128(
        x_ptr,
        q_ptr,
        s_ptr,
        qt_ptr,
        st_ptr,
        M,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sk,
        stride_qtk,
        stride_stk,
        stride_stm,
        eps,
        UE8M0: tl.constexpr,
        TRANSPOSED: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = pid_m * 128 + tl.arange(0, 128)
        offs_k = pid_k * 128 + tl.arange(0, 128)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0
        s = scale_of(amax, has_nan, eps, UE8M0)
        q = to_e4m3(x, s)
        tl.store(q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :], q, mask=mask)
        tl.store(s_ptr + pid_m * stride_sm + pid_k * stride_sk, s)
        if TRANSPOSED:
            qt_ptrs = qt_ptr + offs_k[:, None].to(tl.int64) * stride_qtk + offs_m[None, :]
            tl.store(qt_ptrs, tl.trans(q), mask=(offs_k[:, None] < K) & (offs_m[None, :] < M))
            tl.store(st_ptr + pid_k * stride_stk + pid_m * stride_stm, s)

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        group_id = pid // width
        first_m = group_id * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % width) % group_size)
        pid_n = (pid % width) // group_size
        return pid_m, pid_n

    @triton.jit
    def _store_c(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, ACC: tl.constexpr):
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ACC:  # FP32 c is the accumulator (main_grad): the product lands on it, as a separate add would
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0) + acc
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _gemm_ptr(
        a_ptr,
        b_ptr,
        c_ptr,
        as_ptr,
        bs_ptr,
        M,
        N,
        K,
        stride_am,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_asm,
        stride_ask,
        stride_bsn,
        stride_bsk,
        B_TILE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        ACC: tl.constexpr,
    ):
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = offs_m % M  # wrapped rows/cols: loads stay in bounds, the store is masked
        rn = offs_n % N
        offs_k = tl.arange(0, 128)
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [128, BLOCK_N], K-major
        as_ptrs = as_ptr + rm * stride_asm
        if B_TILE:
            bs_ptrs = bs_ptr + (rn // 128) * stride_bsn
        else:
            bs_ptrs = bs_ptr + rn * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_tiles = tl.cdiv(K, 128)
        for kb in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - kb * 128, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K - kb * 128, other=0.0)
            sa = tl.load(as_ptrs + kb * stride_ask)
            if B_TILE and (128 % BLOCK_N == 0):
                acc += tl.dot(a, b) * (sa * tl.load(bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn + kb * stride_bsk))[:, None]
            else:
                sb = tl.load(bs_ptrs + kb * stride_bsk)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            a_ptrs += 128
            b_ptrs += 128
        _store_c(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, ACC)

    @triton.jit
    def _gemm_tma(
        a_desc,
        b_desc,
        c_ptr,
        as_ptr,
        bs_ptr,
        M,
        N,
        K,
        stride_cm,
        stride_cn,
        stride_asm,
        stride_ask,
        stride_bsn,
        stride_bsk,
        B_TILE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        LOOKAHEAD: tl.constexpr,
        WS: tl.constexpr,
        ACC: tl.constexpr,
    ):
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rm = offs_m % M
        rn = offs_n % N
        as_ptrs = as_ptr + rm * stride_asm
        if B_TILE:
            bs_ptrs = bs_ptr + (rn // 128) * stride_bsn
        else:
            bs_ptrs = bs_ptr + rn * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_tiles = tl.cdiv(K, 128)
        SCALAR_B: tl.constexpr = B_TILE and (128 % BLOCK_N == 0)  # the tile's columns share one B scale
        if SCALAR_B:
            bs1 = bs_ptr + (off_n // 128) * stride_bsn
        if LOOKAHEAD:  # issue the next block's MMA before scaling the previous block's product
            a = a_desc.load([off_m, 0])
            b = b_desc.load([off_n, 0])
            p = tl.dot(a, b.T)
            if SCALAR_B:
                sc = tl.load(as_ptrs) * tl.load(bs1)
            else:
                sc = tl.load(as_ptrs)
                sbv = tl.load(bs_ptrs)
            for kb in tl.range(1, k_tiles, num_stages=NUM_STAGES):
                a = a_desc.load([off_m, kb * 128])
                b = b_desc.load([off_n, kb * 128])
                p_next = tl.dot(a, b.T)
                if SCALAR_B:
                    acc += p * sc[:, None]
                    sc = tl.load(as_ptrs + kb * stride_ask) * tl.load(bs1 + kb * stride_bsk)
                else:
                    acc += p * (sc[:, None] * sbv[None, :])
                    sc = tl.load(as_ptrs + kb * stride_ask)
                    sbv = tl.load(bs_ptrs + kb * stride_bsk)
                p = p_next
            if SCALAR_B:
                acc += p * sc[:, None]
            else:
                acc += p * (sc[:, None] * sbv[None, :])
        else:
            for kb in tl.range(0, k_tiles, num_stages=NUM_STAGES, warp_specialize=WS):
                a = a_desc.load([off_m, kb * 128])  # out-of-bounds (partial K, M, N) reads as zero
                b = b_desc.load([off_n, kb * 128])
                sa = tl.load(as_ptrs + kb * stride_ask)
                if SCALAR_B:
                    acc += tl.dot(a, b.T) * (sa * tl.load(bs1 + kb * stride_bsk))[:, None]
                else:
                    sb = tl.load(bs_ptrs + kb * stride_bsk)
                    acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        _store_c(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn, ACC)

    @triton.jit
    def _swiglu_bwd(
        gu_ptr,
        dy_ptr,
        d_ptr,
        M,
        I,
        stride_gm,
        stride_dym,
        stride_dm,
        BLOCK_M: tl.constexpr,
        BLOCK_I: tl.constexpr,
    ):
        # d[gate | up] of silu(gate) * up in autograd's own roundings (torch 2.11 CUDA kernels, opmath FP32):
        # MulBackward d_up = dy * silu(gate) and dy * up, each rounded to the dtype; SiluBackward
        # dy' * s * (1 + x * (1 - s)) with s = 1 / (1 + expf(-x)), with 1 + x * (1 - s) as one FMA
        # (as nvcc contracts it: the form whose bits equalled torch 2.11's on an H100, tests/gpu/test_kernels.py)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = (offs_m[:, None] < M) & (offs_i[None, :] < I)
        rows = offs_m[:, None].to(tl.int64)
        g = tl.load(gu_ptr + rows * stride_gm + offs_i[None, :], mask=mask, other=0.0)
        u = tl.load(gu_ptr + rows * stride_gm + I + offs_i[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_i[None, :], mask=mask, other=0.0)
        g32, dy32 = g.to(tl.float32), dy.to(tl.float32)
        e = 1.0 + libdevice.exp(-g32)
        act = div_rn(g32, e).to(g.dtype)  # F.silu: x / (1 + expf(-x))
        d_up = (dy32 * act.to(tl.float32)).to(g.dtype)
        t = (dy32 * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        sig = div_rn(tl.zeros_like(e) + 1.0, e)
        d_gate = (t * sig) * tl.fma(g32, 1.0 - sig, 1.0)
        d_ptrs = d_ptr + rows * stride_dm + offs_i[None, :]
        tl.store(d_ptrs, d_gate.to(g.dtype), mask=mask)
        tl.store(d_ptrs + I, d_up, mask=mask)

    @triton.jit
    def _transpose_bytes(src_ptr, dst_ptr, N, K, stride_s, stride_d, BLOCK: tl.constexpr):
        # one program: a BLOCK x BLOCK tile of src [N, K] -> dst [K, N] (E4M3 bytes as uint8: no value is touched)
        offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        offs_k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tile = tl.load(
            src_ptr + offs_n[:, None].to(tl.int64) * stride_s + offs_k[None, :],
            mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
        )
        tl.store(
            dst_ptr + offs_k[:, None].to(tl.int64) * stride_d + offs_n[None, :],
            tl.trans(tile),
            mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
        )

    kernels = {
        "transpose_bytes": _transpose_bytes,
        "swiglu_bwd": _swiglu_bwd,
        "quant_1x128": _quant_1x128,
        "quant_dual": _quant_dual,
        "quant_cols": _quant_cols,
        "quant_128x128": _quant_128x128,
        "gemm_ptr": _gemm_ptr,
        "gemm_tma": _gemm_tma,
    }
    return {name: Launcher(fn) for name, fn in kernels.items()}


# ----------------------------------------------------------------------------------------------------
# Quantizer wrappers


def swiglu_backward(gate_up: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    """d[gate | up] `[M, 2I]` of `silu(gate) * up` for gate_up `[M, 2I]` and d_out `[M, I]` (2-D, unit stride along
    the last dim): one pass, the bits of torch's autograd of `F.silu(gate) * up` (tests/gpu/test_kernels.py)."""
    m, i = d_out.shape
    if gate_up.shape != (m, 2 * i) or gate_up.stride(-1) != 1 or d_out.stride(-1) != 1:
        raise ValueError(
            f"swiglu_backward takes gate_up [M, 2I] and d_out [M, I] with unit last stride, got "
            f"{tuple(gate_up.shape)} (strides {gate_up.stride()}) and {tuple(d_out.shape)} (strides {d_out.stride()})"
        )
    d = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    if m and i:
        bm, bi = 8, 512
        _k()["swiglu_bwd"][(triton_cdiv(m, bm), triton_cdiv(i, bi))](
            gate_up, d_out, d, m, i, gate_up.stride(0), d_out.stride(0), d.stride(0), BLOCK_M=bm, BLOCK_I=bi, num_warps=4
        )
    return d


# ----------------------------------------------------------------------------------------------------


def _check_args(x, scale_mode, fp8_ok=False):
    if x.dtype not in INPUT_DTYPES and not (fp8_ok and x.dtype == E4M3):
        raise TypeError(f"the FP8 quantizer takes {', '.join(map(str, INPUT_DTYPES))}, got {x.dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if not tensor_supported(x):
        raise RuntimeError(f"the Triton FP8 kernels need a CUDA GPU with sm89+ and Triton; got {x.device}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, K] with unit stride along K (copies only when the layout needs it)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[-1] > 0 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _outer_major_empty(m, kb, device):
    """[m, kb] FP32 with strides (1, m): the layout cuBLASLt and DeepGEMM want for 1x128 scales (no copy later)."""
    return torch.empty_strided((m, kb), (1, m), dtype=torch.float32, device=device)


def _finite_or_raise(x, s, block, check_finite):
    if check_finite and not bool(torch.isfinite(s).all()):
        _raise_non_finite(x, block)


def division_steps(dtype, eps: float) -> int:
    """`to_e4m3`'s DIV for values of `dtype` (the SwiGLU product has its input's): the Markstein corrections that make
    x * RN(1/s) the IEEE x / s. One for BF16 (8 significant bits: checked exhaustively, as cuda_tiles.divide is); two
    for wider significands (the first leaves q within one ulp, Markstein's theorem's premise). 0, the IEEE division,
    below eps = 2^-50: a scale under 2^-60 could underflow the residual."""
    if eps < 2.0**-50:
        return 0
    return 1 if dtype == torch.bfloat16 else 2


# Launch settings, chosen by the sweep in tools/bench/bench_fp8.py on the H200 (see BENCHMARKS.md).
QUANT_CFG = {
    # mode "cuda": fp8/cuda_tiles.py's kernel (rows only) for 2-D BF16 input whose layout allows its 16-byte accesses;
    # else, in mode "triton" and with the SwiGLU prologue, the Triton kernel with these launch settings (SwiGLU in a
    # CUDA tile kernel measured slower: 61% of the copy rate against Triton's 67%, H200)
    "1x128": dict(mode="cuda", block_m=16, groups=1, num_warps=4),
    # mode "cuda": fp8/cuda_tiles.py's kernel with one scale per tile (BLOCK128) where the layout allows; "triton" else
    "128x128": dict(mode="cuda"),
    "cols": dict(block_n=64, num_warps=4, trans=True, tma=False),  # from BF16: 49-50% of copy (TMA stores: no gain)
    "cols_fp8": dict(block_n=32, num_warps=4, trans=True, tma=True),  # from E4M3 + scales: 39.5% (64/ptr: 31.7%)
    # cuda: fp8/cuda_tiles.py, one read of x for both outputs, where its layout allows (else split); cuda-split: the
    # Triton 1x128 kernel + the CUDA 128x1^T kernel; split: the Triton 1x128 kernel + the Triton cols kernel (two reads
    # of x); fused: one Triton kernel (19-21% of copy)
    "dual": dict(mode="cuda", num_warps=8),
    # swiglu_backward_dual: "cuda" = fp8/cuda_tiles.py's swiglu_bwd_tile (d[gate | up] never stored; checked once per
    # device against "split" at first use); "split" = swiglu_backward, then quantize_dual. Split ships: on an H200
    # the one kernel is bit-exact but takes 1402 us against 773 for the two (16384 tokens, I = 8192; layer 1.29x vs 1.42x);
    # on an H100 3.5 ms against 2.6 (32768 tokens, I = 12288). A CTA per d[gate] or d[up] tile (2.3 ms) and both divisions
    # through RN(1/e) gave the layer nothing either (BENCHMARKS.md): the two streaming kernels stay.
    "swiglu_bwd": dict(mode="split"),
}


def quantize_1x128(
    x,
    scale_mode="fp32",
    *,
    eps=EPS,
    check_finite=True,
    swiglu=False,
    block_m=None,
    num_warps=None,
    groups=None,
    mode=None,
    product=None,
    scale=None,
):
    """1x128 quantization of `x[..., K]` (bytes of `quantize_blockwise(x, (1, 128))`).

    Returns `(q, s)`: q `[..., K]` E4M3, s `[..., ceil(K/128)]` FP32; for 2-D input s has strides
    (1, M) (outer-dim-major), or those of `scale` when given (a preallocated `[M, ceil(K/128)]` FP32 output, e.g.
    vLLM's TMA-aligned column-major layout). With `swiglu=True`, x is `[..., 2I]` = [gate | up] and the quantized
    tensor is `silu(gate) * up` rounded to x's dtype (see tests/gpu for the byte check against torch), which is
    also written to `product` (2-D `[M, I]` of x's dtype, unit stride along I) when given.
    """
    _check_args(x, scale_mode)
    shape = x.shape
    x2 = _rows(x)
    m, k = x2.shape
    if swiglu:
        if k % 2:
            raise ValueError(f"swiglu quantization needs an even last dim ([gate | up]), got {k}")
        k //= 2
    kb = -(-k // GROUP)
    if product is not None and (
        not swiglu or tuple(product.shape) != (m, k) or product.dtype != x.dtype or product.stride(-1) != 1
    ):
        raise ValueError(
            f"product must be a [{m}, {k}] {x.dtype} tensor with unit stride along its last dim, for swiglu "
            f"quantization; got {tuple(product.shape)} {product.dtype} (swiglu={swiglu})"
        )
    if scale is not None and (len(shape) != 2 or tuple(scale.shape) != (m, kb) or scale.dtype != torch.float32):
        raise ValueError(f"scale must be a [{m}, {kb}] float32 tensor for 2-D input, got {tuple(scale.shape)} {scale.dtype}")
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = _outer_major_empty(m, kb, x.device) if scale is None else scale
    cfg = QUANT_CFG["1x128"]
    bm = block_m or cfg["block_m"]
    g = groups or cfg["groups"]
    mode = mode or cfg["mode"]
    if mode not in ("cuda", "triton"):
        raise ValueError(f"quantize_1x128 mode must be 'cuda' or 'triton', got {mode!r}")
    if mode == "cuda" and not (swiglu or block_m or num_warps or groups) and cuda_tiles.takes(x2, None, cols=False):
        cuda_tiles.quantize(x2, None, q, s, None, None, float(eps), scale_mode == "ue8m0")
    elif m and k:
        p = q if product is None else product
        _k()["quant_1x128"][(triton_cdiv(m, bm), triton_cdiv(kb, g))](
            x2,
            q,
            s,
            m,
            k,
            x2.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            float(eps),
            p,
            p.stride(0),
            BLOCK_M=bm,
            G=g,
            UE8M0=scale_mode == "ue8m0",
            SWIGLU=swiglu,
            EVEN=(m % bm == 0 and k % (g * GROUP) == 0),
            PRODUCT=product is not None,
            DIV=division_steps(x.dtype, eps),
            num_warps=num_warps or cfg["num_warps"],
        )
    out_shape = shape[:-1] + (k,)
    if check_finite and not bool(torch.isfinite(s).all()):
        if swiglu:
            g, u = x2[:, :k], x2[:, k:]
            _raise_non_finite(torch.nn.functional.silu(g) * u, (1, 128))
        _raise_non_finite(x, (1, 128))
    if len(shape) == 2:
        return q, s
    return q.reshape(out_shape), s.contiguous().reshape(scale_shape(out_shape, (1, 128)))


def swiglu_quantize_1x128(gate_up, scale_mode="fp32", **kw):
    return quantize_1x128(gate_up, scale_mode, swiglu=True, **kw)


def _quant_cols(x2, xs, qt, st, t, n, eps, fp8_in, ue8m0, block_n=None, num_warps=None, trans=None, tma=None):
    cfg = QUANT_CFG["cols_fp8" if fp8_in else "cols"]
    bn = block_n or cfg["block_n"]
    grid = (triton_cdiv(t, GROUP), triton_cdiv(n, bn))
    even = t % GROUP == 0 and n % bn == 0
    warps = num_warps or cfg["num_warps"]
    use_tma = (cfg["tma"] if tma is None else tma) and _tma_ok(qt)
    qt_arg = qt
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qt_arg = TensorDescriptor.from_tensor(qt, [bn, GROUP])
    _k()["quant_cols"][grid](
        x2,
        xs,
        qt_arg,
        st,
        t,
        n,
        x2.stride(0),
        xs.stride(0),
        xs.stride(1),
        qt.stride(0),
        st.stride(0),
        st.stride(1),
        float(eps),
        BLOCK_N=bn,
        FP8_IN=fp8_in,
        UE8M0=ue8m0,
        EVEN=even,
        TRANS=cfg["trans"] if trans is None else trans,
        TMA=use_tma,
        num_warps=warps,
    )


def quantize_dual(
    x,
    scale_mode="fp32",
    *,
    eps=EPS,
    check_finite=True,
    rows=True,
    cols=True,
    x_scale=None,
    num_warps=None,
    mode=None,
    cols_cfg=None,
):
    """One pass over a 2-D `x[T, N]`: 1x128 groups along N and 128x1 groups along T, the latter transposed.

    Returns `(q, s, qt, st)`: q `[T, N]` and s `[T, ceil(N/128)]` (strides (1, T)) are
    `quantize_blockwise(x, (1, 128))`; qt `[N, T]` contiguous and st `[N, ceil(T/128)]` (strides (1, N))
    are `quantize_blockwise(x, (128, 1))` transposed: the K-major WGrad operand with its 1x128 scales.
    `rows=False` / `cols=False` skip one output (returned as None). With `x_scale` given, x is E4M3
    bytes with 1x128 scales `x_scale[T, ceil(N/128)]` and the quantized tensor is their FP32
    dequantization (`dequantize_blockwise(x, x_scale, (1, 128))`).
    """
    fp8_in = x_scale is not None
    _check_args(x, scale_mode, fp8_ok=fp8_in)
    if x.dim() != 2:
        raise ValueError(f"quantize_dual takes a 2-D [tokens, features] tensor, got shape {tuple(x.shape)}")
    if fp8_in and (x.dtype != E4M3 or tuple(x_scale.shape) != scale_shape(x.shape, (1, 128))):
        raise ValueError("x_scale must come with E4M3 x and have the 1x128 scale shape")
    if not fp8_in and x.dtype == E4M3:
        raise TypeError("E4M3 input needs its x_scale")
    x2 = _rows(x)
    t, n = x2.shape
    tb, nb = -(-t // GROUP), -(-n // GROUP)
    q, s, qt, st = _dual_outputs(t, n, rows, cols, x.device)
    dummy8 = qt if q is None else q
    dummy32 = st if s is None else s
    xs = x_scale if fp8_in else dummy32
    mode = mode or QUANT_CFG["dual"]["mode"]
    ue8m0 = scale_mode == "ue8m0"
    if mode in ("cuda", "cuda-split") and cols_cfg is None and (rows or cols) and cuda_tiles.takes(x2, x_scale):
        if mode == "cuda-split" and rows and cols and not fp8_in:  # Triton's 1x128 kernel + the CUDA 128x1^T kernel
            q, s = quantize_1x128(x2, scale_mode, eps=eps, check_finite=False, mode="triton")
            cuda_tiles.quantize(x2, None, None, None, qt, st, float(eps), ue8m0)
        else:
            cuda_tiles.quantize(x2, x_scale, q, s, qt, st, float(eps), ue8m0)
    elif t and n and cols and (not rows or (mode in ("split", "cuda", "cuda-split") and not fp8_in)):
        if rows:  # two kernels, x read twice (measured faster than the fused one-pass kernel on the H200)
            q, s = quantize_1x128(x2, scale_mode, eps=eps, check_finite=False)
        _quant_cols(x2, x_scale if fp8_in else st, qt, st, t, n, eps, fp8_in, ue8m0, **(cols_cfg or {}))
    elif t and n and (rows or cols):
        _k()["quant_dual"][(tb, nb)](
            x2,
            xs,
            q if rows else dummy8,
            s if rows else dummy32,
            qt if cols else dummy8,
            st if cols else dummy32,
            t,
            n,
            x2.stride(0),
            xs.stride(0),
            xs.stride(1),
            (q if rows else dummy8).stride(0),
            (s if rows else dummy32).stride(0),
            (s if rows else dummy32).stride(1),
            (qt if cols else dummy8).stride(0),
            (st if cols else dummy32).stride(0),
            (st if cols else dummy32).stride(1),
            float(eps),
            FP8_IN=fp8_in,
            ROWS=rows,
            COLS=cols,
            UE8M0=scale_mode == "ue8m0",
            EVEN=(t % GROUP == 0 and n % GROUP == 0),
            num_warps=num_warps or QUANT_CFG["dual"]["num_warps"],
        )
    if check_finite:
        for sc, blk in ((s, (1, 128)), (st, (128, 1))):
            if sc is not None and not bool(torch.isfinite(sc).all()):
                from megatron_jetrl.fp8.quant import dequantize_blockwise

                _raise_non_finite(dequantize_blockwise(x, x_scale, (1, 128)) if fp8_in else x, blk)
    return q, s, qt, st


def swiglu_backward_dual(gate_up, d_out, scale_mode="fp32", *, eps=EPS, rows=True, cols=True, mode=None):
    """`quantize_dual(swiglu_backward(gate_up, d_out), check_finite=False, rows=rows, cols=cols)`: the FP8 up
    projection's DGrad (1x128) and WGrad (128x1, transposed) operands of d[gate | up], gate_up `[T, 2I]`, d_out `[T, I]`.

    Mode "cuda" (where `cuda_tiles.takes_swiglu`): one kernel, d[gate | up] never stored in BF16; its bytes are
    compared with "split"'s once per device, scale mode and output set, and a difference raises. "split": the two
    kernels."""
    _check_args(gate_up, scale_mode)
    mode = mode or QUANT_CFG["swiglu_bwd"]["mode"]
    if mode not in ("cuda", "split"):
        raise ValueError(f"swiglu_backward_dual mode must be 'cuda' or 'split', got {mode!r}")
    if mode == "cuda" and (rows or cols) and cuda_tiles.takes_swiglu(gate_up, d_out):
        _check_fused_swiglu(gate_up.device, scale_mode, float(eps), rows, cols)
        return _swiglu_dual_cuda(gate_up, d_out, scale_mode, eps, rows, cols)
    return quantize_dual(swiglu_backward(gate_up, d_out), scale_mode, eps=eps, check_finite=False, rows=rows, cols=cols)


def _dual_outputs(t: int, n: int, rows: bool, cols: bool, device):
    """`quantize_dual`'s empty outputs for a [T, N] input: (q, s) if rows, (qt, st) if cols, else Nones."""
    q, s = (torch.empty(t, n, dtype=E4M3, device=device), _outer_major_empty(t, -(-n // GROUP), device)) if rows else (None, None)
    qt, st = (
        (torch.empty(n, t, dtype=E4M3, device=device), _outer_major_empty(n, -(-t // GROUP), device)) if cols else (None, None)
    )
    return q, s, qt, st


def _swiglu_dual_cuda(gate_up, d_out, scale_mode, eps, rows, cols):
    q, s, qt, st = _dual_outputs(*gate_up.shape, rows, cols, gate_up.device)
    cuda_tiles.quantize_swiglu_backward(gate_up, d_out, q, s, qt, st, float(eps), scale_mode == "ue8m0")
    return q, s, qt, st


@functools.cache
def _check_fused_swiglu(device, scale_mode: str, eps: float, rows: bool, cols: bool) -> None:
    """Once per device, scale mode and output set (one host sync): the fused kernel's bytes on a probe of 144 tokens
    x 2 x 256 features (a partial token tile; zero, tiny, huge, infinite and NaN gates, tiny and huge up / d_out)
    equal the two-kernel path's."""
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(144, 512, device=device, generator=g) * 4).to(torch.bfloat16)
    d_out = torch.randn(144, 256, device=device, generator=g).to(torch.bfloat16)
    special = [0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0, 90.0, -90.0, 1e-38, -1e-38, float("inf"), -float("inf"), float("nan")]
    gate_up[0, : len(special)] = torch.tensor(special)
    gate_up[1, 256 : 256 + len(special)] = torch.tensor(special)
    d_out[2, :4] = torch.tensor([1e-38, -1e4, 3e38, float("nan")])
    fused = _swiglu_dual_cuda(gate_up, d_out, scale_mode, eps, rows, cols)
    split = quantize_dual(swiglu_backward(gate_up, d_out), scale_mode, eps=eps, check_finite=False, rows=rows, cols=cols)
    bad = [
        name
        for name, a, b in zip(("rows", "row scales", "columns", "column scales"), fused, split)
        if a is not None
        and not torch.equal(
            a.view(torch.uint8) if a.dtype == E4M3 else a.view(torch.int32),
            b.view(torch.uint8) if b.dtype == E4M3 else b.view(torch.int32),
        )
    ]
    if bad:
        raise RuntimeError(
            f"the fused SwiGLU-backward quantizer (fp8/cuda_tiles.py swiglu_bwd_tile) differs from "
            f"swiglu_backward + quantize_dual on {device} ({scale_mode} scales) in its {', '.join(bad)}; "
            "set megatron_jetrl.fp8.kernels.QUANT_CFG['swiglu_bwd']['mode'] = 'split' and report it"
        )


def transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """`q.t().contiguous()` of a 2-D E4M3 (or uint8) tensor in one Triton pass (torch's copy of a one-byte transpose
    runs at a fraction of the memory rate): DGrad's W^T bytes when they are made per backward."""
    if q.dim() != 2 or q.element_size() != 1:
        raise ValueError(f"transpose_bytes takes a 2-D one-byte tensor, got {q.dtype} of shape {tuple(q.shape)}")
    src = q.view(torch.uint8)
    if src.stride(1) != 1:
        src = src.contiguous()
    n, k = src.shape
    out = torch.empty(k, n, dtype=torch.uint8, device=q.device)
    if n and k:
        block = 64
        _k()["transpose_bytes"][(-(-n // block), -(-k // block))](
            src, out, n, k, src.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(q.dtype)


def quantize_128x128(w, scale_mode="fp32", *, eps=EPS, check_finite=True, transposed=False, mode=None):
    """128x128 tiles of a 2-D `w[N, K]` (bytes of `quantize_blockwise(w, (128, 128))`).

    Returns `(q, s)` or, with `transposed=True`, `(q, s, qt, st)` where `qt = q.t().contiguous()` and
    `st = s.t().contiguous()` (the bytes and scales of quantizing `w.t()`: a tile has a single scale).
    """
    _check_args(w, scale_mode)
    if w.dim() != 2:
        raise ValueError(f"quantize_128x128 takes a 2-D weight, got shape {tuple(w.shape)}")
    w2 = _rows(w)
    n, k = w2.shape
    nb, kb = -(-n // GROUP), -(-k // GROUP)
    q = torch.empty(n, k, dtype=E4M3, device=w.device)
    s = torch.empty(nb, kb, dtype=torch.float32, device=w.device)
    qt = torch.empty(k, n, dtype=E4M3, device=w.device) if transposed else q
    st = torch.empty(kb, nb, dtype=torch.float32, device=w.device) if transposed else s
    mode = mode or QUANT_CFG["128x128"]["mode"]
    if mode not in ("cuda", "triton"):
        raise ValueError(f"quantize_128x128 mode must be 'cuda' or 'triton', got {mode!r}")
    if mode == "cuda" and cuda_tiles.takes(w2, None, cols=transposed):
        cuda_tiles.quantize(
            w2,
            None,
            q,
            s,
            qt if transposed else None,
            st if transposed else None,
            float(eps),
            scale_mode == "ue8m0",
            block128=True,
        )
    elif n and k:
        _k()["quant_128x128"][(nb, kb)](
            w2,
            q,
            s,
            qt,
            st,
            n,
            k,
            w2.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            qt.stride(0),
            st.stride(0),
            st.stride(1),
            float(eps),
            UE8M0=scale_mode == "ue8m0",
            TRANSPOSED=transposed,
            num_warps=8,
        )
    _finite_or_raise(w, s, (128, 128), check_finite)
    return (q, s, qt, st) if transposed else (q, s)


def quantize(x, block, scale_mode="fp32", *, eps=EPS, check_finite=True):
    """`quantize_blockwise` semantics (same shapes, same bytes) through the Triton kernels for 2-D input."""
    block = tuple(block)
    if block == (1, 128):
        return quantize_1x128(x, scale_mode, eps=eps, check_finite=check_finite)
    if x.dim() != 2:
        raise ValueError(f"the Triton {block} quantizer takes 2-D input, got shape {tuple(x.shape)}")
    if block == (128, 128):
        return quantize_128x128(x, scale_mode, eps=eps, check_finite=check_finite)
    if block == (128, 1):
        _, _, qt, st = quantize_dual(x, scale_mode, eps=eps, check_finite=check_finite, rows=False)
        return qt.t(), st.t()
    raise ValueError(f"block must be one of (1, 128), (128, 1), (128, 128); got {block}")


def triton_cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages, use_tma); chosen by the sweep in tools/bench/bench_fp8.py
GEMM_CONFIG = {
    "tile": (128, 128, 8, 8, 4, True),  # 807 TFLOP/s on the 8B gate_up at M=8192 (the sweep, H200)
    "rows": (128, 128, 8, 8, 4, True),  # WGrad (per-element sa*sb): 451-488 TFLOP/s on an H200 at T = 8192
}
"""Triton is the portable fallback: on Hopper DeepGEMM's WGrad runs at 864-941 TFLOP/s on the same shapes. Also timed
there (H200, BENCHMARKS.md): the one-block lookahead (7th field) 441-466 TFLOP/s, warp specialization
(8th field) 481-538, 64x256 and 256x128 tiles 197-407; none is the default."""


def _tma_ok(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def gemm(a_q, a_s, b_q, b_s, b_block=(128, 128), out_dtype=torch.bfloat16, *, config=None, out=None, accumulate=False):
    """`dequant(a) @ dequant(b)^T` (operands as in `megatron_jetrl.fp8.gemm.blockwise_gemm`), on Triton.

    a [M, K] and b [N, K] need unit stride along K (K-major); any scale strides work, outer-dim-major
    1x128 scales are read coalesced. `accumulate=True` adds the FP32 product into `out` (FP32 [M, N]).
    """
    if accumulate and (out is None or out.dtype != torch.float32):
        raise ValueError("gemm(accumulate=True) adds into `out`: pass an FP32 [M, N] buffer as out=")
    b_tile = tuple(b_block) == (128, 128)
    cfg = config or GEMM_CONFIG["tile" if b_tile else "rows"]
    bm, bn, gm, warps, stages, use_tma = cfg[:6]
    lookahead = len(cfg) > 6 and bool(cfg[6])
    ws = len(cfg) > 7 and bool(cfg[7])
    if a_q.stride(1) != 1:
        a_q = a_q.contiguous()
    if b_q.stride(1) != 1:
        b_q = b_q.contiguous()
    m, k = a_q.shape
    n = b_q.shape[0]
    c = out if out is not None else torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c if accumulate else c.zero_()
    kern = _k()
    grid = (triton_cdiv(m, bm) * triton_cdiv(n, bn),)
    if use_tma and _tma_ok(a_q) and _tma_ok(b_q):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a_q, [bm, 128])
        b_desc = TensorDescriptor.from_tensor(b_q, [bn, 128])
        kern["gemm_tma"][grid](
            a_desc,
            b_desc,
            c,
            a_s,
            b_s,
            m,
            n,
            k,
            c.stride(0),
            c.stride(1),
            a_s.stride(0),
            a_s.stride(1),
            b_s.stride(0),
            b_s.stride(1),
            B_TILE=b_tile,
            BLOCK_M=bm,
            BLOCK_N=bn,
            GROUP_M=gm,
            NUM_STAGES=stages,
            LOOKAHEAD=lookahead,
            WS=ws,
            ACC=accumulate,
            num_warps=warps,
        )
    else:
        kern["gemm_ptr"][grid](
            a_q,
            b_q,
            c,
            a_s,
            b_s,
            m,
            n,
            k,
            a_q.stride(0),
            b_q.stride(0),
            c.stride(0),
            c.stride(1),
            a_s.stride(0),
            a_s.stride(1),
            b_s.stride(0),
            b_s.stride(1),
            B_TILE=b_tile,
            BLOCK_M=bm,
            BLOCK_N=bn,
            GROUP_M=gm,
            EVEN_K=(k % 128 == 0),
            NUM_STAGES=stages,
            ACC=accumulate,
            num_warps=warps,
        )
    return c


__all__ = [
    "GEMM_CONFIG",
    "gemm",
    "quantize",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_dual",
    "supported",
    "swiglu_quantize_1x128",
    "triton_available",
]
