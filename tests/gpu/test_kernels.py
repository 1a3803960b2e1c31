"""GPU checks of the FP8 kernels and GEMM backends (skipped without CUDA; run tools/gpu/run_gpu_tests.sh on the H200).

Quantizers: bytes and scales identical to the reference quantizer (itself checked on CUDA against its CPU
bytes) on fresh random and adversarial inputs, partial blocks, bf16/fp16/fp32. GEMM backends: against the
emulated (exact per-block FP64) reference on fresh inputs, into poisoned outputs, including K/128 = 5 and
N/128 >= 2 (the cuBLASLt scale-pitch trap). The FP8 linear on CUDA: bit-identical to the CPU reference path.
"""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from megatron_jetrl.fp8 import FP8Linear, NonFiniteInputError, PrecisionFlow, blockwise_gemm, quantize_blockwise
from megatron_jetrl.fp8.gemm import available_backends, gemm_emulated
from megatron_jetrl.fp8.quant import wire_bytes

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("fp32", "ue8m0")


def kernels():
    from megatron_jetrl.fp8 import kernels as k

    return k


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def adversarial(m, k, dtype, seed):
    """Random data with planted hard cases: ties on the E4M3 grid, saturation, tiny/subnormal values, zero groups."""
    g = gen(seed)
    x = torch.randn(m, k, device=DEV, generator=g) * torch.exp(torch.randn(m, 1, device=DEV, generator=g) * 3)
    if m == 0 or k == 0:
        return x.to(dtype)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values.to(DEV)
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties once the scale is a power of two
    r = torch.randint(0, 6, (m,), device=DEV, generator=g)
    for i in range(min(m, 64)):
        kind = int(r[i])
        if kind == 0:  # ties: amax 448 * 2**e makes s = 2**e exactly
            lo, hi = (-10, 5) if dtype == torch.float16 else (-20, 20)
            e = int(torch.randint(lo, hi, (1,), device=DEV, generator=g))
            idx = torch.randint(0, mids.numel(), (k,), device=DEV, generator=g)
            row = mids[idx] * torch.where(torch.rand(k, device=DEV, generator=g) < 0.5, -1.0, 1.0)
            row[::128] = 448.0
            x[i] = row * 2.0**e
        elif kind == 1:
            x[i] = 0.0
            x[i, ::7] = -0.0
        elif kind == 2:  # huge dynamic range inside a group: most values underflow to E4M3 subnormals/zero
            x[i] = torch.randn(k, device=DEV, generator=g) * 1e-6
            x[i, ::128] = 3e4 if dtype != torch.float16 else 6e4
        elif kind == 3:  # tiny groups: amax below eps (and below bf16/fp16 normal range for fp32)
            x[i] = torch.randn(k, device=DEV, generator=g) * (1e-12 if dtype == torch.float32 else 1e-7)
        elif kind == 4 and dtype != torch.float16:
            x[i] = torch.randn(k, device=DEV, generator=g) * 1e30
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # keep fp16 finite: non-finite input is tested separately
    return x.to(dtype)


def same(a, b):
    return torch.equal(wire_bytes(a), wire_bytes(b))


def same_scales(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


SHAPES = [(1, 128), (7, 100), (128, 128), (130, 385), (256, 640), (300, 1000), (1024, 4096)]


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
@pytest.mark.parametrize("mode", MODES)
def test_reference_quantizer_on_cuda_gives_the_cpu_bytes(block, mode):
    for i, (dtype, (m, k)) in enumerate(itertools.product(DTYPES, SHAPES[:6])):
        x = adversarial(m, k, dtype, seed=100 + i)
        q_gpu, s_gpu = quantize_blockwise(x, block, mode)
        q_cpu, s_cpu = quantize_blockwise(x.cpu(), block, mode)
        assert same(q_gpu.cpu(), q_cpu), (dtype, m, k)
        assert same_scales(s_gpu.cpu(), s_cpu), (dtype, m, k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_1x128_bytes(dtype, mode):
    k = kernels()
    for i, (m, n) in enumerate(SHAPES):
        for seed in (i, 1000 + i):
            x = adversarial(m, n, dtype, seed)
            q, s = k.quantize_1x128(x, mode)
            rq, rs = quantize_blockwise(x, (1, 128), mode)
            assert same(q, rq) and same_scales(s, rs), (m, n, seed)
            assert s.stride() == (1, m) or m == 1
            for bm, groups in ((8, 2),) if dtype == torch.bfloat16 else ():  # other launch shapes: same bytes
                q2, s2 = k.quantize_1x128(x, mode, block_m=bm, groups=groups)
                assert same(q2, rq) and same_scales(s2, rs), (m, n, bm, groups)
    x = adversarial(6 * 40, 300, dtype, 7).reshape(6, 40, 300)  # leading batch dims
    q, s = k.quantize_1x128(x, mode)
    rq, rs = quantize_blockwise(x, (1, 128), mode)
    assert q.shape == rq.shape and s.shape == rs.shape and same(q, rq) and same_scales(s, rs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dual_bytes_both_layouts(dtype, mode):
    k = kernels()
    for i, (m, n) in enumerate(SHAPES + [(257, 128), (100, 1)]):
        x = adversarial(m, n, dtype, 50 + i)
        q, s, qt, st = k.quantize_dual(x, mode)
        rq, rs = quantize_blockwise(x, (1, 128), mode)
        tq, ts = quantize_blockwise(x, (128, 1), mode)
        assert same(q, rq) and same_scales(s, rs), (m, n)
        assert qt.shape == (n, m) and qt.is_contiguous() and same(qt, tq.t()), (m, n)
        assert st.shape == (n, ts.shape[0]) and same_scales(st, ts.t()), (m, n)
        _, _, qt2, st2 = k.quantize_dual(x, mode, rows=False)
        assert same(qt2, qt) and same_scales(st2, st)
        for dual_mode in ("fused", "split") if dtype == torch.bfloat16 else ():
            q3, s3, qt3, st3 = k.quantize_dual(x, mode, mode=dual_mode)
            assert same(q3, rq) and same_scales(s3, rs) and same(qt3, tq.t()) and same_scales(st3, ts.t()), dual_mode
        for cfg in (
            dict(block_n=32, trans=False),
            dict(block_n=128, trans=True),
            dict(tma=True),
            dict(tma=True, block_n=128),
            dict(tma=True, block_n=32, num_warps=8),
            dict(tma=False),
        ):
            _, _, qt4, st4 = k.quantize_dual(x, mode, rows=False, cols_cfg=cfg)
            assert same(qt4, tq.t()) and same_scales(st4, ts.t()), cfg
            q5, s5, qt5, st5 = k.quantize_dual(x, mode, cols_cfg=cfg)
            assert same(q5, rq) and same_scales(s5, rs) and same(qt5, tq.t()) and same_scales(st5, ts.t()), cfg


@pytest.mark.parametrize("mode", MODES)
def test_requantize_saved_activation_along_tokens(mode):
    """X's E4M3 bytes + 1x128 scales -> 128x1 along tokens, as dequantize_blockwise then quantize_blockwise."""
    from megatron_jetrl.fp8 import dequantize_blockwise

    k = kernels()
    for i, (m, n) in enumerate(SHAPES):
        x = adversarial(m, n, torch.bfloat16, 300 + i)
        xq, xs = k.quantize_1x128(x, mode)
        tq, ts = quantize_blockwise(dequantize_blockwise(xq, xs, (1, 128)), (128, 1), mode)
        for cfg in (None, dict(block_n=32, trans=False), dict(block_n=128, trans=True), dict(tma=True), dict(tma=False)):
            _, _, qt, st = k.quantize_dual(xq, mode, rows=False, x_scale=xs, cols_cfg=cfg)
            assert same(qt, tq.t()) and same_scales(st, ts.t()), (m, n, cfg)
        _, _, qt, st = k.quantize_dual(xq, mode, x_scale=xs, mode="fused")
        assert same(qt, tq.t()) and same_scales(st, ts.t()), (m, n)


CUDA_TILE_SHAPES = [(16, 8), (128, 128), (144, 136), (272, 1000), (1024, 4096), (4096, 1536)]


@pytest.mark.parametrize("mode", MODES)
def test_cuda_tile_kernel_bytes_rows_cols_and_from_e4m3(mode):
    """fp8/cuda_tiles.py (the default dual/cols quantizer where the layout allows): partial tiles in both dims,
    adversarial groups, all three outputs sets (rows+cols, cols only, rows only) and the saved-activation input."""
    from megatron_jetrl.fp8 import cuda_tiles, dequantize_blockwise

    k = kernels()
    assert cuda_tiles.available(), "torch.cuda._compile_kernel is missing: the CUDA tile kernel cannot run"
    for i, (m, n) in enumerate(CUDA_TILE_SHAPES):
        x = adversarial(m, n, torch.bfloat16, 700 + i)
        assert cuda_tiles.takes(x, None), (m, n)
        rq, rs = quantize_blockwise(x, (1, 128), mode)
        tq, ts = quantize_blockwise(x, (128, 1), mode)
        for dual_mode in ("cuda", "cuda-split"):
            q, s, qt, st = k.quantize_dual(x, mode, mode=dual_mode)
            assert same(q, rq) and same_scales(s, rs), (m, n, dual_mode)
            assert same(qt, tq.t()) and same_scales(st, ts.t()), (m, n, dual_mode)
        _, _, qt2, st2 = k.quantize_dual(x, mode, mode="cuda", rows=False)
        assert same(qt2, tq.t()) and same_scales(st2, ts.t()), (m, n)
        q3, s3, _, _ = k.quantize_dual(x, mode, mode="cuda", cols=False)
        assert same(q3, rq) and same_scales(s3, rs), (m, n)
        xq, xs = k.quantize_1x128(x, mode)
        assert cuda_tiles.takes(xq, xs), (m, n)
        tq8, ts8 = quantize_blockwise(dequantize_blockwise(xq, xs, (1, 128)), (128, 1), mode)
        _, _, qt4, st4 = k.quantize_dual(xq, mode, mode="cuda", rows=False, x_scale=xs)
        assert same(qt4, tq8.t()) and same_scales(st4, ts8.t()), (m, n)
    # a strided row view (ld 8 elements larger) is taken; an odd leading dim is left to Triton, same bytes
    base = adversarial(256, 520, torch.bfloat16, 790)
    view = base[:, :512]
    assert cuda_tiles.takes(view, None) and not cuda_tiles.takes(base[:250], None)
    _, _, qt, st = k.quantize_dual(view, mode, mode="cuda", rows=False)
    tq, ts = quantize_blockwise(view, (128, 1), mode)
    assert same(qt, tq.t()) and same_scales(st, ts.t())


@pytest.mark.parametrize("fp8_in", [False, True])
def test_tile_division_is_correctly_rounded_for_every_significand_pair(fp8_in):
    """fp8/cuda_tiles.py's x / s (x * RN(1/s) with one FMA correction for BF16 input, two for E4M3 input) equals the
    IEEE division for every 8-bit significand of x and every 24-bit significand of s: 2^30 pairs, exhaustive for
    BF16 input (other exponents scale the same operations by exact powers of two)."""
    from megatron_jetrl.fp8 import cuda_tiles

    kern = torch.cuda._compile_kernel(cuda_tiles.source(fp8_in, True, True, False), "check_divide")
    bad = torch.zeros(1, dtype=torch.int64, device=DEV)
    first = torch.full((1,), 1 << 30, dtype=torch.int32, device=DEV)
    kern(grid=((1 << 23) // 256, 1, 1), block=(256, 1, 1), args=[bad, first])
    torch.cuda.synchronize()
    assert int(bad) == 0, f"{int(bad)} (x, s) pairs differ from __fdiv_rn; first s = 1 + 0x{int(first):06x} / 2^23"


def test_tile_swiglu_gradient_equals_the_triton_kernel_for_every_bf16_gate():
    """fp8/cuda_tiles.py's SwiGLU gradient (`swiglu_grad`, the fused SwiGLU-backward quantizer's) equals
    `kernels.swiglu_backward` (torch's autograd roundings) in every bit of d[gate] and d[up], for all 65536 BF16 gate
    values, each with 4 draws of up and dy over a wide range (NaN results: both NaN, payloads aside)."""
    from megatron_jetrl.fp8 import cuda_tiles

    k = kernels()
    kern = torch.cuda._compile_kernel(cuda_tiles.source(False, True, True, False), "check_swiglu")
    bits = torch.arange(65536, dtype=torch.int32, device=DEV)
    g = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    for draw in range(4):
        gg = gen(1200 + draw)
        u, dy = (
            (torch.randn(65536, device=DEV, generator=gg) * torch.exp(torch.randn(65536, device=DEV, generator=gg) * 3)).to(
                torch.bfloat16
            )
            for _ in range(2)
        )
        out = torch.empty(65536, dtype=torch.int32, device=DEV)
        kern(
            grid=(256, 1, 1), block=(256, 1, 1), args=[g.view(torch.int16), u.view(torch.int16), dy.view(torch.int16), out, 65536]
        )
        want = k.swiglu_backward(torch.cat([g.view(512, 128), u.view(512, 128)], dim=1), dy.view(512, 128))
        for name, got, ref in (
            ("d[gate]", (out & 0xFFFF).to(torch.int16), want[:, :128].reshape(-1)),
            ("d[up]", (out >> 16).to(torch.int16), want[:, 128:].reshape(-1)),
        ):
            got_f = got.view(torch.bfloat16)
            differ = (got != ref.view(torch.int16)) & ~(torch.isnan(got_f) & torch.isnan(ref))
            assert not bool(differ.any()), (draw, name, int(differ.sum()), g[differ][:4].float().tolist())


@functools.cache
def _triton_division_counter():
    """A Triton kernel counting, for one x row and 2^23 scales s = 1 + k / 2^23 (every 24-bit significand), the pairs
    where `quant_math`'s `divide(x, s, DIV)` differs from the IEEE division in any bit."""
    import triton
    import triton.language as tl

    div_rn, _, _, divide = kernels().quant_math()

    @triton.jit
    def count(x_ptr, bad_ptr, NX: tl.constexpr, BLOCK_S: tl.constexpr, DIV: tl.constexpr):
        k = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        s = (k | 0x3F800000).to(tl.float32, bitcast=True)[:, None]
        x = tl.load(x_ptr + tl.arange(0, NX))[None, :]
        v = divide(x, s, DIV)
        ref = div_rn(x + tl.zeros_like(v), s + tl.zeros_like(v))
        tl.atomic_add(
            bad_ptr, tl.sum(tl.sum((v.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True)).to(tl.int32), 1), 0)
        )

    return count


@pytest.mark.parametrize("div, significand_bits", [(1, 8), (2, 11), (2, 24)])
def test_triton_division_is_correctly_rounded(div, significand_bits):
    """The Triton quantizers' x / s with one reciprocal per group (`divide`, DIV = `division_steps`) equals the IEEE
    division bit for bit, for every 24-bit significand of s: exhaustive over x's significands for BF16 (8 bits, one
    correction) and FP16 (11 bits, two); for FP32 (two corrections: Markstein's theorem once the first leaves q within
    an ulp), 2^10 random 24-bit significands. Other exponents scale the same operations by exact powers of two."""
    k = kernels()
    if significand_bits == 24:
        xs = 1.0 + torch.randint(0, 1 << 23, (1024,), generator=torch.Generator().manual_seed(0)).double() / 2**23
    else:
        xs = 1.0 + torch.arange(1 << (significand_bits - 1)).double() / 2 ** (significand_bits - 1)
    assert k.division_steps({8: torch.bfloat16, 11: torch.float16, 24: torch.float32}[significand_bits], k.EPS) == div
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    x = xs.float().to(DEV)
    for chunk in x.split(128):
        _triton_division_counter()[((1 << 23) // 64,)](chunk, bad, NX=128, BLOCK_S=64, DIV=div, num_warps=8)
    assert int(bad) == 0, f"{int(bad)} (x, s) pairs differ from div.rn.f32 (DIV={div}, {significand_bits}-bit x)"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_quantizer_division_edges(dtype, mode):
    """The Triton 1x128 kernel (`mode="triton"`, the SwiGLU quantizer's, and fp16/fp32 input's) on the groups where a
    reciprocal-based division could go wrong: +-0 beside huge and tiny values, subnormals, the dtype's largest values,
    an infinite or NaN element (scale inf / NaN), all-zero groups; and with eps below 2^-50, where it divides the IEEE
    way (DIV 0). The reference's bytes and scales in every case."""
    k = kernels()
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    rows = [
        [0.0, -0.0] * 63 + [big, -big],
        [-0.0] * 127 + [tiny],
        [tiny / 4, -tiny / 8] * 63 + [1.0, -0.0],
        [1e-3, -1e-3] * 63 + [float("inf"), -0.0],
        [2.0, -0.0] * 63 + [float("nan"), 5.0],
        [-0.0] * 128,
        [448.0 * 2.0**-20, -(2.0**-30)] * 64,
    ]
    x = torch.tensor(rows, dtype=torch.float64).clamp(-big, big).to(dtype).to(DEV)
    x = torch.cat([x, adversarial(57, 128, dtype, 77)])
    for eps in (k.EPS, 1e-30):
        assert k.division_steps(dtype, eps) == (0 if eps < 2.0**-50 else 1 if dtype == torch.bfloat16 else 2)
        q, s = k.quantize_1x128(x, mode, eps=eps, check_finite=False, mode="triton")
        rq, rs = quantize_blockwise(x, (1, 128), mode, eps=eps, check_finite=False)
        nan = torch.isnan(rs)  # a NaN scale's payload is not part of the contract
        assert int(nan.sum()) == 1 and torch.equal(torch.isnan(s), nan), (dtype, mode, eps)
        assert same(q, rq) and same_scales(s.masked_fill(nan, 0), rs.masked_fill(nan, 0)), (dtype, mode, eps)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_tile_kernel_bytes_1x128_and_128x128(mode):
    """The CUDA tile kernel behind the shipped 1x128 (rows only: any token count) and 128x128 (one scale per tile,
    with and without the transposed copy) quantizers: the reference's bytes and scales on partial tiles and
    adversarial groups, and the same bytes as the Triton kernels they replace."""
    from megatron_jetrl.fp8 import cuda_tiles

    k = kernels()
    for i, (m, n) in enumerate(CUDA_TILE_SHAPES + [(1, 8), (17, 136), (4099, 1024), (16384, 512)]):
        x = adversarial(m, n, torch.bfloat16, 820 + i)
        assert cuda_tiles.takes(x, None, cols=False), (m, n)
        rq, rs = quantize_blockwise(x, (1, 128), mode)
        q, s = k.quantize_1x128(x, mode)
        assert same(q, rq) and same_scales(s, rs), (m, n)
        assert s.stride() == (1, m) or m == 1, (m, n, s.stride())
        q2, s2 = k.quantize_1x128(x, mode, mode="triton")
        assert same(q2, rq) and same_scales(s2, rs), (m, n)
        wq, ws = quantize_blockwise(x, (128, 128), mode)
        q, s = k.quantize_128x128(x, mode)
        assert same(q, wq) and same_scales(s, ws), (m, n)
        if cuda_tiles.takes(x, None):  # the transposed copy needs whole 16-token chunks
            tq, ts = quantize_blockwise(x.t().contiguous(), (128, 128), mode)
            q, s, qt, st = k.quantize_128x128(x, mode, transposed=True)
            assert same(q, wq) and same_scales(s, ws) and same(qt, tq) and same_scales(st, ts), (m, n)
            q3, s3, qt3, st3 = k.quantize_128x128(x, mode, transposed=True, mode="triton")
            assert same(q3, wq) and same(qt3, tq) and same_scales(st3, ts), (m, n)


SWIGLU_TILE_SHAPES = [(16, 128), (144, 256), (272, 384), (1040, 1536), (4096, 3072)]  # (tokens T, I)


@pytest.mark.parametrize("mode", MODES)
def test_fused_swiglu_backward_quantizer_equals_the_two_kernels(mode):
    """kernels.swiglu_backward_dual(mode="cuda") (fp8/cuda_tiles.py swiglu_bwd_tile: d[gate | up] never stored) ==
    quantize_dual(swiglu_backward(gate_up, d_out)) byte for byte: partial token tiles, large / tiny / infinite / NaN
    gates and gradients, rows + cols, cols only, rows only; inputs it does not take fall back to the same bytes."""
    from megatron_jetrl.fp8 import cuda_tiles

    k = kernels()
    for n, (t, i) in enumerate(SWIGLU_TILE_SHAPES):
        g = gen(900 + n)
        gate_up = (torch.randn(t, 2 * i, device=DEV, generator=g) * torch.exp(torch.randn(t, 1, device=DEV, generator=g) * 2)).to(
            torch.bfloat16
        )
        d_out = adversarial(t, i, torch.bfloat16, 950 + n)
        gate_up[0, :10] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0, 90.0, -90.0, float("inf"), -float("inf")])
        gate_up[-1, i : i + 4] = torch.tensor([1e-38, -1e-38, 3e38, float("nan")])
        assert cuda_tiles.takes_swiglu(gate_up, d_out), (t, i)
        want = k.quantize_dual(k.swiglu_backward(gate_up, d_out), mode, check_finite=False)
        for rows, cols in ((True, True), (False, True), (True, False)):
            got = k.swiglu_backward_dual(gate_up, d_out, mode, rows=rows, cols=cols, mode="cuda")
            for name, a, b, on in zip(("rows", "row scales", "cols", "col scales"), got, want, (rows, rows, cols, cols)):
                if not on:
                    assert a is None
                elif a.dtype == torch.float8_e4m3fn:
                    assert same(a, b), (t, i, rows, cols, name)
                else:
                    assert same_scales(a, b), (t, i, rows, cols, name)
    # not taken (I % 128, T % 16, FP16): the two kernels, the same bytes as quantizing the BF16 gradient
    for t, i, dtype in ((64, 200, torch.bfloat16), (40, 256, torch.bfloat16), (64, 256, torch.float16)):
        gu, dy = torch.randn(t, 2 * i, device=DEV).to(dtype), torch.randn(t, i, device=DEV).to(dtype)
        assert not cuda_tiles.takes_swiglu(gu, dy)
        got = k.swiglu_backward_dual(gu, dy, mode, mode="cuda")
        want = k.quantize_dual(k.swiglu_backward(gu, dy), mode, check_finite=False)
        assert all(same(a, b) if a.dtype == torch.float8_e4m3fn else same_scales(a, b) for a, b in zip(got, want))


def test_fused_swiglu_backward_through_the_gated_mlp(monkeypatch):
    """Public path: fc1 -> fc2(gated SiLU) with a GatedGradHandoff and the fused kernel gives the output and all
    gradients of the MLP without the handoff, bit for bit (into main_grad, as under megatron DDP)."""
    from megatron_jetrl.fp8 import GatedGradHandoff, fp8_linear

    k = kernels()
    monkeypatch.setitem(k.QUANT_CFG, "swiglu_bwd", dict(mode="cuda"))
    g = gen(990)
    x = torch.randn(4, 512, 1024, device=DEV, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(2 * 1536, 1024, device=DEV, generator=g) * 0.03).to(torch.bfloat16)
    w2 = (torch.randn(1024, 1536, device=DEV, generator=g) * 0.03).to(torch.bfloat16)
    dy = torch.randn(4, 512, 1024, device=DEV, generator=g).to(torch.bfloat16)
    flow = PrecisionFlow(mode="jetrl")
    outs = []
    for handoff in (None, GatedGradHandoff()):
        xx = x.clone().requires_grad_(True)
        a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        a.main_grad = torch.zeros(a.shape, dtype=torch.float32, device=DEV)
        y = fp8_linear(fp8_linear(xx, a, flow=flow, handoff=handoff), b, flow=flow, gated_act=F.silu, handoff=handoff)
        y.backward(dy)
        outs.append((y, xx.grad, a.main_grad, b.grad))
    for a, b in zip(*outs):
        assert torch.equal(
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
            b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32),
        )


def test_cuda_tile_kernel_poisons_non_finite_groups():
    k = kernels()
    x = torch.randn(256, 512, device=DEV).to(torch.bfloat16)
    x[3, 200] = float("inf")
    x[130, 7] = float("nan")
    with pytest.raises(NonFiniteInputError):
        k.quantize_dual(x, mode="cuda")
    q, s, qt, st = k.quantize_dual(x, check_finite=False, mode="cuda")
    rq, rs = quantize_blockwise(x, (1, 128), check_finite=False)
    tq, ts = quantize_blockwise(x, (128, 1), check_finite=False)
    for got, want in ((s, rs), (st, ts.t())):
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isnan(q.float()), torch.isnan(rq.float()))
    assert torch.equal(torch.isnan(qt.float()), torch.isnan(tq.t().float()))
    finite = torch.isfinite(rs).repeat_interleave(128, dim=1)[:, :512]
    assert torch.equal(q.view(torch.uint8)[finite], rq.view(torch.uint8)[finite])
    q, s = k.quantize_1x128(x, check_finite=False, mode="cuda")  # rows only
    assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.equal(torch.isinf(s), torch.isinf(rs))
    assert torch.equal(q.view(torch.uint8)[finite], rq.view(torch.uint8)[finite])
    assert torch.equal(torch.isnan(q.float()), torch.isnan(rq.float()))
    with pytest.raises(NonFiniteInputError):
        k.quantize_1x128(x, mode="cuda")
    with pytest.raises(NonFiniteInputError):
        k.quantize_128x128(x, mode="cuda")
    wq, ws = quantize_blockwise(x, (128, 128), check_finite=False)
    q, s, qt, st = k.quantize_128x128(x, check_finite=False, transposed=True, mode="cuda")
    assert torch.equal(torch.isnan(s), torch.isnan(ws)) and torch.equal(torch.isnan(st), torch.isnan(ws.t()))
    assert torch.equal(torch.isnan(q.float()), torch.isnan(wq.float())) and torch.equal(
        torch.isnan(qt.float()), torch.isnan(wq.float().t())
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_128x128_bytes_and_transposed_copy(dtype, mode):
    k = kernels()
    for i, (m, n) in enumerate(SHAPES + [(384, 640)]):
        w = adversarial(m, n, dtype, 500 + i)
        q, s, qt, st = k.quantize_128x128(w, mode, transposed=True)
        rq, rs = quantize_blockwise(w, (128, 128), mode)
        assert same(q, rq) and same_scales(s, rs), (m, n)
        tq, ts = quantize_blockwise(w.t().contiguous(), (128, 128), mode)
        assert same(qt, tq) and same_scales(st, ts), (m, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_fused_quantization_equals_quantizing_torch_swiglu(dtype):
    k = kernels()
    for i, (m, n) in enumerate([(64, 256), (100, 300), (1024, 2048)]):
        gu = torch.randn(m, 2 * n, device=DEV, generator=gen(900 + i), dtype=torch.float32).mul(3).to(dtype)
        h = F.silu(gu[:, :n]) * gu[:, n:]
        q, s = k.swiglu_quantize_1x128(gu)
        rq, rs = quantize_blockwise(h, (1, 128))
        assert same(q, rq) and same_scales(s, rs), (m, n)


def test_swiglu_quantization_also_writes_the_product_into_a_given_scale_layout():
    """vLLM's fused SiLU-and-mul (`rollout.vllm_glue.silu_mul_quant`): the BF16 product torch gives, its quantizer
    bytes, and the scales in the preallocated TMA-aligned column-major buffer (rows rounded up to 4 apart)."""
    k = kernels()
    for i, (m, n) in enumerate([(1, 128), (6, 256), (100, 384), (128, 1536)]):
        gu = torch.randn(m, 2 * n, device=DEV, generator=gen(990 + i)).mul(3).to(torch.bfloat16)
        if m > 3:
            gu[2, :128] = 0.0  # a zero group: the eps floor
            gu[3, n : n + 128] = float("inf")  # silu * inf: a non-finite group, NaN/inf scale like the reference's
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        buf = torch.empty_strided((m, n // 128), (1, -(-m // 4) * 4), device=DEV, dtype=torch.float32)
        q, s = k.swiglu_quantize_1x128(gu, check_finite=False, product=out, scale=buf)
        h = F.silu(gu[:, :n]) * gu[:, n:]
        rq, rs = quantize_blockwise(h, (1, 128), check_finite=False)
        assert s is buf and torch.equal(out.view(torch.int16), h.view(torch.int16))
        assert same(q, rq) and same_scales(s, rs), (m, n)
    with pytest.raises(ValueError, match="product must be"):
        k.swiglu_quantize_1x128(gu, product=torch.empty(m, n + 1, device=DEV, dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", MODES)
def test_swiglu_fused_quantization_on_adversarial_groups(mode):
    """The SwiGLU-fused quantizer divides BF16 products by the group's scale with one reciprocal and one Markstein
    correction (`division_steps`): the reference's bytes on zero, tie, tiny and huge (1e30) groups, and with an
    infinite product in one row (its scale inf, its neighbours in the same program unaffected)."""
    k = kernels()
    for i, (m, n) in enumerate([(64, 256), (100, 384), (1040, 1536)]):
        up = adversarial(m, n, torch.bfloat16, 950 + i)
        gate = torch.randn(m, n, device=DEV, generator=gen(960 + i)).mul(3).to(torch.bfloat16)
        gu = torch.cat([gate, up], dim=1)
        q, s = k.swiglu_quantize_1x128(gu, mode)
        rq, rs = quantize_blockwise(F.silu(gate) * up, (1, 128), mode)
        assert same(q, rq) and same_scales(s, rs), (m, n)
    gu[65, 0], gu[65, n] = 1.0, float("inf")  # silu(1) * inf
    q, s = k.swiglu_quantize_1x128(gu, mode, check_finite=False)
    rq, rs = quantize_blockwise(F.silu(gu[:, :n]) * gu[:, n:], (1, 128), mode, check_finite=False)
    rows = torch.arange(gu.shape[0], device=DEV) != 65
    assert same(q[rows], rq[rows]) and same_scales(s[rows], rs[rows]) and same(q[65, 128:], rq[65, 128:])
    assert not torch.isfinite(s[65, 0]) and not torch.isfinite(rs[65, 0])


def test_non_finite_raises_or_poisons():
    k = kernels()
    x = torch.randn(256, 512, device=DEV)
    x[3, 200] = float("inf")
    x[130, 7] = float("nan")
    for fn in (lambda: k.quantize_1x128(x), lambda: k.quantize_dual(x), lambda: k.quantize_128x128(x)):
        with pytest.raises(NonFiniteInputError):
            fn()
    q, s = k.quantize_1x128(x, check_finite=False)
    rq, rs = quantize_blockwise(x, (1, 128), check_finite=False)
    assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.equal(torch.isinf(s), torch.isinf(rs))
    assert torch.equal(torch.isnan(q.float()), torch.isnan(rq.float()))
    assert not torch.isfinite(s[3, 1]) and torch.isnan(s[130, 0])
    _, _, qt, st = k.quantize_dual(x, check_finite=False)
    assert torch.isnan(qt[200, :128].float()).any() and not torch.isfinite(st[200, 0])
    clean = torch.ones(512, dtype=torch.bool, device=DEV)
    clean[[7, 200]] = False
    assert (qt[clean].float().abs() <= 448).all() and torch.isfinite(st[clean]).all()


# ----------------------------------------------------------------------------------------------------
# GEMM backends
# ----------------------------------------------------------------------------------------------------

GEMM_SHAPES = [
    (64, 256, 640),
    (200, 384, 640),
    (128, 256, 896),
    (256, 512, 1024),
    (33, 130, 300),
    (1000, 777, 1408),
    (512, 1024, 4096),
]


def fast_backends():
    have = [b for b in available_backends(DEV) if b != "emulated"]
    assert "triton" in have
    return have


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_backends_match_emulated_with_fresh_inputs(b_block):
    for i, (m, n, kk) in enumerate(GEMM_SHAPES):
        g = gen(2000 + i)
        a = torch.randn(m, kk, device=DEV, generator=g) * 2
        b = torch.randn(n, kk, device=DEV, generator=g) * 0.03
        a_q, a_s = quantize_blockwise(a, (1, 128))
        b_q, b_s = quantize_blockwise(b, b_block)
        want = gemm_emulated(a_q, a_s, b_q, b_s, b_block, torch.float64)
        for backend in fast_backends():
            if backend == "cublaslt" and (kk % 16 or m % 16 or n % 16):
                continue  # cuBLASLt wants dims that are multiples of 16 (torch checks)
            if backend == "deepgemm" and n % 8:
                with pytest.raises(ValueError, match=r"DeepGEMM needs N % 8 == 0"):
                    blockwise_gemm(a_q, a_s, b_q, b_s, b_block=b_block, backend=backend)
                continue
            for out_dtype in (torch.float32, torch.bfloat16):
                got = blockwise_gemm(a_q, a_s, b_q, b_s, b_block=b_block, out_dtype=out_dtype, backend=backend)
                assert got.dtype == out_dtype and got.shape == (m, n)
                assert torch.isfinite(got).all(), (backend, m, n, kk)
                bf16_inside = backend == "deepgemm" and b_block == (128, 128)  # DeepGEMM's 1D2D writes BF16
                tol = 1e-3 if out_dtype == torch.float32 and not bf16_inside else 4e-3  # FP8 tensor-core sums: ~2e-4
                assert rel(got, want) < tol, (backend, out_dtype, m, n, kk, rel(got, want))


def test_triton_gemm_configs_write_every_element():
    k = kernels()
    configs = [
        (128, 128, 8, 8, 4, True),
        (128, 128, 8, 8, 3, False),
        (128, 256, 8, 8, 3, True),
        (128, 64, 8, 4, 5, True),
        (128, 64, 8, 4, 4, True, True),
        (128, 128, 8, 8, 3, True, True),
        (128, 128, 8, 8, 4, True, False, True),
    ]
    for i, ((m, n, kk), b_block, cfg) in enumerate(
        itertools.product([(300, 640, 640), (129, 256, 1000)], [(128, 128), (1, 128)], configs)
    ):
        g = gen(3000 + i)
        a_q, a_s = quantize_blockwise(torch.randn(m, kk, device=DEV, generator=g), (1, 128))
        b_q, b_s = quantize_blockwise(torch.randn(n, kk, device=DEV, generator=g), b_block)
        out = torch.full((m, n), float("nan"), device=DEV)
        k.gemm(a_q, a_s, b_q, b_s, b_block, torch.float32, config=cfg, out=out)
        want = gemm_emulated(a_q, a_s, b_q, b_s, b_block, torch.float64)
        assert torch.isfinite(out).all() and rel(out, want) < 1e-3, (cfg, m, n, kk, b_block)
        k.gemm(a_q, a_s, b_q, b_s, b_block, torch.float32, config=cfg, out=out, accumulate=True)  # out += product
        assert rel(out, 2 * want) < 1e-3, ("accumulate", cfg, m, n, kk, b_block)


def test_cublaslt_k_blocks_not_multiple_of_4_with_transposed_weight():
    """The DGrad operand is W^T: K/128 = N_w/128; check 5 and 7 K-blocks, N/128 = 2..3, against emulated."""
    if "cublaslt" not in available_backends(DEV):
        pytest.skip("no cuBLASLt blockwise on this device")
    for i, (m, n_w, k_w) in enumerate([(128, 640, 256), (256, 896, 384), (64, 640, 512)]):
        g = gen(4000 + i)
        w_q, w_s = quantize_blockwise(torch.randn(n_w, k_w, device=DEV, generator=g) * 0.05, (128, 128))
        dy_q, dy_s = quantize_blockwise(torch.randn(m, n_w, device=DEV, generator=g), (1, 128))
        want = gemm_emulated(dy_q, dy_s, w_q.t().contiguous(), w_s.t().contiguous(), (128, 128), torch.float64)
        for backend in fast_backends():
            got = blockwise_gemm(dy_q, dy_s, w_q.t(), w_s.t(), out_dtype=torch.float32, backend=backend)
            tol = 4e-3 if backend == "deepgemm" else 1e-3  # DeepGEMM's 1D2D writes BF16
            assert rel(got, want) < tol, (backend, m, n_w, k_w, rel(got, want))


# ----------------------------------------------------------------------------------------------------
# FP8 linear on CUDA
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_fp8_linear_on_cuda_is_bit_identical_to_the_cpu_reference(mode):
    """Triton quantizers in forward and backward + emulated GEMM on CUDA == the CPU reference path, bit for bit."""
    flow = PrecisionFlow(mode="jetrl", backend="emulated", scale_mode=mode)
    for i, (t, cin, cout) in enumerate([(256, 384, 640), (300, 640, 256)]):
        torch.manual_seed(i)
        cpu = FP8Linear(cin, cout, bias=True, flow=flow, dtype=torch.bfloat16)
        gpu = FP8Linear(cin, cout, bias=True, flow=flow, dtype=torch.bfloat16, device=DEV)
        gpu.load_state_dict(cpu.state_dict())
        x = torch.randn(t, cin).to(torch.bfloat16)
        if t % 2 == 0:
            x = x.reshape(2, t // 2, cin)  # leading batch dims
        dy = torch.randn(*x.shape[:-1], cout).to(torch.bfloat16)
        outs = []
        for mod, dev in ((cpu, "cpu"), (gpu, DEV)):
            xx = x.detach().clone().to(dev).requires_grad_(True)
            y = mod(xx)
            y.backward(dy.to(dev))
            outs.append([y.detach().cpu(), xx.grad.cpu(), mod.weight.grad.cpu(), mod.bias.grad.cpu()])
        for a, b, name in zip(outs[0][:3], outs[1][:3], ("y", "dx", "dw")):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, t, cin, cout)
        assert rel(outs[0][3], outs[1][3]) < 1e-2  # db: an FP32 sum whose order differs between devices


def test_fp8_linear_fast_backends_close_to_emulated():
    for backend in fast_backends():
        flow = PrecisionFlow(mode="jetrl", backend=backend, check_finite="off")
        ref_flow = PrecisionFlow(mode="jetrl", backend="emulated")
        torch.manual_seed(0)
        mod = FP8Linear(640, 896, bias=False, flow=flow, dtype=torch.bfloat16, device=DEV)
        ref = FP8Linear(640, 896, bias=False, flow=ref_flow, dtype=torch.bfloat16, device=DEV)
        ref.load_state_dict(mod.state_dict())
        x = torch.randn(512, 640, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(512, 896, device=DEV, dtype=torch.bfloat16)
        res = []
        for m in (mod, ref):
            xx = x.clone().requires_grad_(True)
            y = m(xx)
            y.backward(dy)
            res.append((y, xx.grad, m.weight.grad))
        for a, b in zip(*res):
            assert rel(a, b) < 5e-3, backend


# ----------------------------------------------------------------------------------------------------
# Shipped defaults: DeepGEMM on Hopper, WGrad into main_grad, no host sync per call
# ----------------------------------------------------------------------------------------------------


def hopper_with_deepgemm():
    from megatron_jetrl.fp8.backends import deep_gemm_module

    return torch.cuda.get_device_capability() == (9, 0) and deep_gemm_module() is not None


def test_auto_is_deepgemm_on_hopper_when_it_imports():
    from megatron_jetrl.fp8.gemm import resolve_backend

    if not hopper_with_deepgemm():
        pytest.skip("DeepGEMM does not import here (unpack .kits/deep_gemm, see tools/gpu/gpu_fp8.sh)")
    assert available_backends(DEV)[0] == "deepgemm"
    assert resolve_backend("auto", torch.device(DEV), 4096) == "deepgemm"
    assert resolve_backend("auto", torch.device(DEV), 777) != "deepgemm"  # N % 8: passed on, not refused


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
@pytest.mark.parametrize("tokens", [8192, 1000])
def test_wgrad_accumulates_into_a_gradient_like_a_separate_add(tokens, backend):
    """DeepGEMM's 1D1D kernel with c = d = main_grad, and the Triton kernel's accumulating store: within FP32
    rounding of `start + product`."""
    if backend == "deepgemm" and not hopper_with_deepgemm():
        pytest.skip("DeepGEMM does not import here")
    g = gen(5000 + tokens)
    dy_t = torch.randn(768, tokens, device=DEV, generator=g)
    x_t = torch.randn(512, tokens, device=DEV, generator=g) * 0.1
    a_q, a_s = quantize_blockwise(dy_t, (1, 128))
    b_q, b_s = quantize_blockwise(x_t, (1, 128))
    product = blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(1, 128), out_dtype=torch.float32, backend=backend)
    start = torch.randn(768, 512, device=DEV, generator=g) * 4
    acc = start.clone()
    assert blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(1, 128), backend=backend, acc=acc) is acc
    bound = 4 * torch.finfo(torch.float32).eps * (start.abs() + product.abs())
    assert ((acc - (start + product)).abs() <= bound).all()
    want = gemm_emulated(a_q, a_s, b_q, b_s, (1, 128), torch.float64)
    assert rel(product, want) < 1e-3


def test_default_fp8_linear_on_gpu_matches_emulated_and_fills_main_grad():
    """`PrecisionFlow(mode="jetrl")` as shipped, megatron-style `main_grad`: y, dX and the accumulated dW
    against the emulated backend on the same quantized operands."""
    torch.manual_seed(1)
    mod = FP8Linear(1024, 1536, bias=False, flow=PrecisionFlow(mode="jetrl"), dtype=torch.bfloat16, device=DEV)
    ref = FP8Linear(
        1024, 1536, bias=False, flow=PrecisionFlow(mode="jetrl", backend="emulated"), dtype=torch.bfloat16, device=DEV
    )
    ref.load_state_dict(mod.state_dict())
    start = torch.randn(1536, 1024, device=DEV)
    mod.weight.main_grad = start.clone()
    x = torch.randn(4, 512, 1024, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(4, 512, 1536, device=DEV, dtype=torch.bfloat16)
    out = []
    for m in (mod, ref):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        y.backward(dy)
        out.append((y, xx.grad))
    assert mod.weight.grad is None
    for a, b in zip(out[0], out[1]):
        assert rel(a, b) < 5e-3
    assert rel(mod.weight.main_grad - start, ref.weight.grad) < 5e-3


def test_default_fp8_linear_never_syncs_the_host_and_the_watch_names_the_layer():
    """Forward + backward with the shipped flow under CUDA's sync debug mode "error": no host sync per call.
    A NaN input is recorded on the device and named by the watch afterwards."""
    from megatron_jetrl.fp8 import finite, fp8_linear

    flow = PrecisionFlow(mode="jetrl")
    w = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(1024, 1024, device=DEV)
    x = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    fp8_linear(x, w, flow=flow).sum().backward()  # first use: backend self-test and JIT outside the check
    bad = x.detach().clone()
    bad[700, 3] = float("nan")
    bad.requires_grad_(True)
    with finite.watch() as watch:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fp8_linear(x, w, flow=flow, site="layers.0.fc1").sum().backward()
            fp8_linear(bad, w, flow=flow, site="layers.1.fc1").sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert watch.first_problem().startswith("layers.1.fc1: input (NaN;")


def test_gated_mlp_input_fused_kernel_equals_unfused_on_gpu():
    """fp8_linear(gate_up, gated_act=silu) on CUDA (one Triton kernel for silu(g) * u + 1x128) == the unfused
    BF16 product quantized by the 1x128 kernel: y, d[gate | up] and the main_grad, bit for bit."""
    from megatron_jetrl.fp8 import fp8_linear

    g = gen(77)
    w = (torch.randn(1024, 1536, device=DEV, generator=g) * 0.03).to(torch.bfloat16)
    gate_up = torch.randn(2, 300, 3072, device=DEV, generator=g).to(torch.bfloat16)
    dy = torch.randn(2, 300, 1024, device=DEV, generator=g).to(torch.bfloat16)
    outs = []
    for fused in (True, False):
        ww = w.clone().requires_grad_(True)
        ww.main_grad = torch.zeros(1024, 1536, device=DEV)
        x = gate_up.clone().requires_grad_(True)
        if fused:
            y = fp8_linear(x, ww, flow=PrecisionFlow(mode="jetrl"), gated_act=F.silu)
        else:
            gate, up = x.chunk(2, dim=-1)
            y = fp8_linear(F.silu(gate) * up, ww, flow=PrecisionFlow(mode="jetrl"))
        y.backward(dy)
        outs.append((y, x.grad, ww.main_grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,i", [(300, 1000), (8, 1536), (1, 128), (4096, 3072)])
def test_swiglu_backward_kernel_equals_autograd(dtype, m, i):
    """kernels.swiglu_backward == torch's autograd of F.silu(gate) * up, bit for bit (odd shapes, large and tiny
    gates, inf)."""
    g = gen(91)
    gate_up = (torch.randn(m, 2 * i, device=DEV, generator=g) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0, float("inf"), -float("inf")])
    dy = torch.randn(m, i, device=DEV, generator=g).to(dtype)
    x = gate_up.clone().requires_grad_(True)
    gate, up = x.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(dy)
    want = x.grad
    got = kernels().swiglu_backward(gate_up, dy)
    bad = int((~((got == want) | (got.isnan() & want.isnan()))).sum())
    assert bad == 0, f"{bad} of {want.numel()} elements differ from autograd's"


@pytest.mark.parametrize("shape", [(128, 128), (4096, 12288), (24576, 4096), (1000, 257), (1, 129), (0, 128)])
def test_transpose_bytes_equals_torch_transpose(shape):
    """DGrad's W^T made per backward (model.fp8_weight_t=backward): every byte where torch's transpose puts it."""
    q = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=gen(7)).view(torch.float8_e4m3fn)
    got = kernels().transpose_bytes(q)
    assert got.dtype == q.dtype and got.shape == (shape[1], shape[0]) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    wide = torch.randint(0, 256, (shape[0], shape[1] + 64), dtype=torch.uint8, device=DEV, generator=gen(8))
    sliced = wide[:, 32 : 32 + shape[1]]  # a row stride wider than the row
    assert torch.equal(kernels().transpose_bytes(sliced), sliced.t().contiguous())


def test_weight_transpose_per_backward_gives_the_kept_gradients_on_cuda():
    from megatron_jetrl.fp8 import QuantizedWeight, fp8_linear

    flow = PrecisionFlow(mode="jetrl")
    w = (torch.randn(384, 512, device=DEV, generator=gen(9)) * 0.05).to(torch.bfloat16).requires_grad_()
    x = torch.randn(256, 512, device=DEV, generator=gen(10)).to(torch.bfloat16)
    grads = []
    for keep in (True, False):
        wq = QuantizedWeight.quantize(w, flow, transposed=keep, keep_t=keep)
        xi = x.clone().requires_grad_()
        fp8_linear(xi, w, flow=flow, weight_q=wq).square().sum().backward()
        grads.append((xi.grad, w.grad.clone()))
        w.grad = None
        assert (wq._t is None) == (not keep)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
