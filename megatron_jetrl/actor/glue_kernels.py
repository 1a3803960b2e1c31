"""Triton kernels for `actor.fused` on CUDA: RMSNorm and RoPE, forward and backward, each one launch.

Why hand-written: at 4096 tokens per micro-batch a Qwen3-8B layer's FP8 GEMMs take less GPU time than the host needs
to issue the layer, and the Inductor-compiled glue pays host work per op and direction (Dynamo's guards, AOTAutograd's
runtime wrappers, Inductor's launcher); a `torch.autograd.Function` around one Triton launch pays one launch.

Both compute the formulas of `actor.fused.rms_norm` / `actor.fused.rope` in FP32 with the same roundings to the
tensor's dtype; a sum (the RMS statistic, the weight gradient) runs in another order and Triton may contract a
multiply-add, so a last bit differs now and then (tests/gpu/test_fused.py bounds it against eager and FP64).
Tensors are addressed as rows of their last dim under up to three leading dims of any strides (megatron's k is a
view of the fused QKV output, SDPA's gradients come back permuted); outputs are contiguous.
"""

from __future__ import annotations

import functools

import torch

from megatron_jetrl.fp8.launch import Launcher


@functools.cache
def _k():
    """The kernels. A row r of a tensor seen as [A, B, C, N] starts at (r // BC) sa + (r % BC // C) sb + (r % C) sc."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from megatron_jetrl.fp8.kernels import quant_math

    _, scale_of, to_e4m3, _ = quant_math()

    @triton.jit
    def _rms_fwd(
        x_ptr,
        w_ptr,
        y_ptr,
        r_ptr,
        res_ptr,
        h_ptr,
        n_rows,
        N,
        inv_n,
        B,
        C,
        sa,
        sb,
        sc,
        eps,
        q_ptr,
        s_ptr,
        stride_sm,
        stride_sg,
        q_eps,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_RES: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        # torch's mean multiplies the sum by 1/N (no division); the rest is the eager formula's op order.
        # HAS_RES (inference): the row normalized is x + residual rounded to x's dtype (torch's add), written to h_ptr
        # QUANT (inference): y as stored (rounded to its dtype) is also quantized in 1x128 groups, the FP8 quantizer's
        # steps (fp8.kernels.quant_math), bytes to q_ptr (rows of N) and scales to s_ptr (row, group strides given).
        # The groups are read back from y's store (after a CTA barrier), not reshaped in registers: with the reshape
        # (the first version) a last bit of y differed from the unfused kernel's in 2e-5 of outputs at width 1024
        # (four rows per program; vLLM's start-up check refused it), as if the RMS sum added in another order. Read
        # back, the norm's part compiles to the unfused kernel's ops and layouts (Triton 3.6 TTGIR, sm_90)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
        r64 = rows.to(tl.int64)
        src = (r64 // (B * C)) * sa + (r64 % (B * C) // C) * sb + (r64 % C) * sc
        out = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + out, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + out, x, mask=mask)
        h = x.to(tl.float32)
        r = libdevice.rsqrt(tl.sum(h * h, axis=1) * inv_n + eps)
        n = (h * r[:, None]).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (w[None, :] * n).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + out, y, mask=mask)
        tl.store(r_ptr + rows, r, mask=rows < n_rows)
        if QUANT:
            tl.debug_barrier()  # this CTA's stores of y are visible to all its threads
            G: tl.constexpr = BLOCK_N // 128
            pairs = tl.program_id(0) * (BLOCK_R * G) + tl.arange(0, BLOCK_R * G)  # (row, group) of this program
            row, grp = pairs // G, pairs % G
            ok = (row < n_rows) & (grp * 128 < N)
            at = row[:, None].to(tl.int64) * N + grp[:, None] * 128 + tl.arange(0, 128)[None, :]
            yq = tl.load(y_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
            s = scale_of(tl.max(tl.abs(yq), axis=1), tl.max((yq != yq).to(tl.int32), axis=1) > 0, q_eps, False)
            tl.store(q_ptr + at, to_e4m3(yq, s[:, None]), mask=ok[:, None])
            tl.store(s_ptr + row.to(tl.int64) * stride_sm + grp * stride_sg, s, mask=ok)

    @triton.jit
    def _rms_bwd(
        x_ptr,
        w_ptr,
        r_ptr,
        dy_ptr,
        dx_ptr,
        dw_ptr,
        n_rows,
        N,
        inv_n,
        B,
        C,
        sa,
        sb,
        sc,
        da,
        db,
        dc,
        iters,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # autograd of y = w * (h * r).to(dtype), r = rsqrt(mean(h^2) + eps), h = x.float(), in its op order:
        # dn = (dy * w) rounded to x's dtype; dh = dn * r + (-0.5 * sum(dn * h) * r^3) / N * 2 h;
        # dw: (dy * n) rounded to dy's dtype, summed over rows (this program's rows here, the programs' sums after)
        pid, progs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for it in range(0, iters):  # row blocks pid, pid + programs, ...
            rows = (pid + it * progs) * BLOCK_R + tl.arange(0, BLOCK_R)
            mask = (rows[:, None] < n_rows) & cmask[None, :]
            r64 = rows.to(tl.int64)
            a, b, c = r64 // (B * C), r64 % (B * C) // C, r64 % C
            x = tl.load(x_ptr + (a * sa + b * sb + c * sc)[:, None] + cols[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + (a * da + b * db + c * dc)[:, None] + cols[None, :], mask=mask, other=0.0)
            r = tl.load(r_ptr + rows, mask=rows < n_rows, other=0.0)
            h = x.to(tl.float32)
            n = (h * r[:, None]).to(x.dtype)
            dn = (dy.to(tl.float32) * w.to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
            dw += tl.sum((dy.to(tl.float32) * n.to(tl.float32)).to(dy.dtype).to(tl.float32), axis=0)
            dr = tl.sum(dn * h, axis=1)
            dv = (-0.5 * dr) * (r * r * r)
            dh = dn * r[:, None] + (dv * inv_n)[:, None] * 2.0 * h
            out = rows[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(dx_ptr + out, dh.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + pid * N + cols, dw, mask=cmask)

    @triton.jit
    def _rope(
        t_ptr,
        cos_ptr,
        sin_ptr,
        y_ptr,
        pos_ptr,
        n_rows,
        HALF,
        B,
        C,
        sa,
        sb,
        sc,
        SIGN: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_POS: tl.constexpr,
    ):
        # forward (SIGN=1): y1 = t1 cos1 - t2 sin1, y2 = t2 cos2 + t1 sin2 (rotate-half, FP32, one rounding);
        # backward (SIGN=-1, t = dy): dt1 = dy1 cos1 + dy2 sin2, dt2 = dy2 cos2 - dy1 sin1.
        # The table row of row r is its leading index a = r // (B C), or with HAS_POS positions[a]
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
        r64 = rows.to(tl.int64)
        src = ((r64 // (B * C)) * sa + (r64 % (B * C) // C) * sb + (r64 % C) * sc)[:, None] + cols[None, :]
        t1 = tl.load(t_ptr + src, mask=mask, other=0.0).to(tl.float32)
        t2 = tl.load(t_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
        lead = r64 // (B * C)
        if HAS_POS:
            lead = tl.load(pos_ptr + lead, mask=rows < n_rows, other=0).to(tl.int64)
        pos = lead[:, None] * (2 * HALF) + cols[None, :]
        c1 = tl.load(cos_ptr + pos, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + pos + HALF, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + pos, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + pos + HALF, mask=mask, other=0.0)
        if SIGN > 0:
            y1, y2 = t1 * c1 - t2 * s1, t2 * c2 + t1 * s2
        else:
            y1, y2 = t1 * c1 + t2 * s2, t2 * c2 - t1 * s1
        out = rows[:, None].to(tl.int64) * (2 * HALF) + cols[None, :]
        tl.store(y_ptr + out, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + out + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)

    return {name: Launcher(fn) for name, fn in {"rms_fwd": _rms_fwd, "rms_bwd": _rms_bwd, "rope": _rope}.items()}


def _rows4(x: torch.Tensor):
    """(rows, B, C, strides of the three leading dims) of `x` seen as `[A, B, C, N]` (unit stride along N; a
    tensor with more leading dims, or another last stride, is made contiguous first)."""
    if x.stride(-1) != 1 or x.dim() > 4:
        x = x.contiguous()
    shape, strides = (1,) * (4 - x.dim()) + tuple(x.shape), (0,) * (4 - x.dim()) + tuple(x.stride())
    return x, shape[0] * shape[1] * shape[2], shape[1], shape[2], strides[:3]


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _blocks(width: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_W, num_warps): rows per program so that one program holds about 4K elements."""
    block_w = _pow2(width)
    return max(1, 4096 // block_w), block_w, 8 if block_w >= 2048 else 4


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x4, n_rows, b, c, (sa, sb, sc) = _rows4(x)
        n = x.shape[-1]
        y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        r = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_r, block_n, warps = _blocks(n)
        if n_rows:
            _k()["rms_fwd"][(-(-n_rows // block_r),)](
                x4,
                weight,
                y,
                r,
                x4,
                x4,
                n_rows,
                n,
                1.0 / n,
                b,
                c,
                sa,
                sb,
                sc,
                float(eps),
                y,
                r,
                0,
                0,
                0.0,
                BLOCK_R=block_r,
                BLOCK_N=block_n,
                HAS_RES=False,
                QUANT=False,
                num_warps=warps,
            )
        ctx.save_for_backward(x4, weight, r)
        ctx.x_strides = (sa, sb, sc)
        return y

    @staticmethod
    def backward(ctx, dy):
        x4, weight, r = ctx.saved_tensors
        dy4, n_rows, b, c, (da, db, dc) = _rows4(dy)
        sa, sb, sc = ctx.x_strides
        n = x4.shape[-1]
        dx = torch.empty(x4.shape, dtype=x4.dtype, device=x4.device)
        block_r, block_n, warps = _blocks(n)
        blocks = -(-n_rows // block_r)
        programs = max(1, min(blocks, 4 * _sms(x4.device.index)))
        partial = torch.empty(programs, n, dtype=torch.float32, device=x4.device)
        if n_rows:
            _k()["rms_bwd"][(programs,)](
                x4,
                weight,
                r,
                dy4,
                dx,
                partial,
                n_rows,
                n,
                1.0 / n,
                b,
                c,
                sa,
                sb,
                sc,
                da,
                db,
                dc,
                -(-blocks // programs),
                BLOCK_R=block_r,
                BLOCK_N=block_n,
                num_warps=warps,
            )
        else:
            partial.zero_()
        return dx, partial.sum(0).to(weight.dtype), None


class RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(t, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope(dy, cos, sin, -1), None, None


def _rope(t, cos, sin, sign: int, positions=None):
    t4, n_rows, b, c, (sa, sb, sc) = _rows4(t)
    half = t.shape[-1] // 2
    y = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    block_r, block_h, warps = _blocks(half)
    if n_rows:
        _k()["rope"][(-(-n_rows // block_r),)](
            t4,
            cos,
            sin,
            y,
            cos if positions is None else positions,
            n_rows,
            half,
            b,
            c,
            sa,
            sb,
            sc,
            SIGN=sign,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            HAS_POS=positions is not None,
            num_warps=warps,
        )
    return y


def add_rms_norm(x, residual, weight, eps: float):
    """Inference only (no autograd): `(rms_norm(h), h)` with `h = x + residual` in x's dtype (torch's add), one kernel
    that writes both. x, residual `[..., N]` of one dtype and shape, residual contiguous."""
    y, h, _, _ = rms_norm_quant(x, residual, weight, eps)
    return y, h


def rms_norm_quant(x, residual, weight, eps: float, quant_eps: float | None = None, scale_rows: int | None = None):
    """Inference only (no autograd): `(y, h, q, s)`. `y = rms_norm(h)` with `h = x + residual` in x's dtype (torch's
    add), or `h = x` (returned as None) without a residual; with `quant_eps` also y's 1x128 FP8 quantization (bytes of
    `fp8.kernels.quantize_1x128(y, eps=quant_eps)`), from the same kernel: q `[rows, N]`, scales `[rows, N / 128]` FP32
    column-major with `scale_rows` (>= rows; vLLM's DeepGEMM wants a multiple of 4) between columns; else q, s are
    None. x, residual `[..., N]` of one dtype and shape, residual contiguous; N % 128 == 0 to quantize."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(
            f"add_rms_norm takes a contiguous residual of x's shape and dtype, got {tuple(residual.shape)} "
            f"{residual.dtype} (contiguous: {residual.is_contiguous()}) for x {tuple(x.shape)} {x.dtype}"
        )
    x4, n_rows, b, c, (sa, sb, sc) = _rows4(x)
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    q = s = None
    if quant_eps is not None:
        scale_rows = n_rows if scale_rows is None else scale_rows
        if n % 128 or scale_rows < n_rows:
            raise ValueError(
                f"rms_norm_quant quantizes rows of a multiple of 128 with scale_rows >= rows; got N={n}, "
                f"{n_rows} rows, scale_rows={scale_rows}"
            )
        q = torch.empty((n_rows, n), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty_strided((n_rows, n // 128), (1, scale_rows), dtype=torch.float32, device=x.device)
    block_r, block_n, warps = _blocks(n)
    if n_rows:
        _k()["rms_fwd"][(-(-n_rows // block_r),)](
            x4,
            weight,
            y,
            r,
            x4 if h is None else residual,
            x4 if h is None else h,
            n_rows,
            n,
            1.0 / n,
            b,
            c,
            sa,
            sb,
            sc,
            float(eps),
            y if q is None else q,
            r if s is None else s,
            0 if s is None else s.stride(0),
            0 if s is None else s.stride(1),
            0.0 if quant_eps is None else float(quant_eps),
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            HAS_RES=h is not None,
            QUANT=q is not None,
            num_warps=warps,
        )
    return y, h, q, s


def rope_at(t, cos, sin, positions):
    """Inference only: `rope(t, cos[positions], sin[positions])` with the table rows read inside the kernel (no gather
    kernels): t `[s, ...]`, positions `[s]` integer, each below the tables' length (not checked on the device)."""
    return _rope(t, cos, sin, 1, positions)
