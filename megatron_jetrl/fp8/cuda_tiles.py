"""A CUDA kernel for the token-grouped (128x1, written transposed) FP8 quantizations of the backward pass, which also
serves the 1x128 rows alone (the forward's activations) and, with one scale per tile, the 128x128 weight tiles.

WGrad wants both operands grouped along tokens and K-major (`[features, tokens]`, tokens contiguous), so the
backward writes a transposed copy of dY and of the saved activation X. In Triton those transposes go through a
register -> shared-memory layout conversion and stayed at 40-50% of the device copy rate in every variant tried
(BENCHMARKS.md); this kernel lays the tile out by hand instead. It computes the contract of
`megatron_jetrl.fp8` (same operations, same order, same roundings as the Triton kernels in `fp8/kernels.py`),
and tests/gpu checks its bytes against the reference quantizer.

One CTA of 256 threads takes a 128 (tokens) x 128 (features) tile. Thread (c, r) = (tid % 16, tid / 16) loads
rows 8r..8r+7, columns 8c..8c+7 with 16-byte loads (8 bytes for E4M3 input), so it holds an 8x8 block:
* rows (1x128 along features): a row's amax is reduced over the 16 threads of a half-warp by shuffles; each
  thread stores its 8 bytes of the row (a half-warp writes 128 contiguous bytes);
* columns (128x1 along tokens): a column's amax is reduced over the thread's 8 rows, the other half-warp
  (shuffle) and the 8 warps (shared memory); each thread's 8 bytes of a column are 8 consecutive tokens of
  one row of the transposed output: they go into a shared 128x128-byte tile (16-byte chunks XOR-swizzled so
  that neither the 8-byte writes nor the 16-byte reads conflict much), which leaves in 16-byte stores.

A second kernel, `swiglu_bwd_tile`, starts from the SwiGLU MLP's saved [gate | up] and the down projection's
DGrad output instead of x: one CTA computes the d[gate] and d[up] tiles of the same 128 tokens x 128 features,
each (token, feature) once with the roundings of `kernels.swiglu_backward` (torch's autograd), and runs the same
row and column passes on each, so d[gate | up] is never stored in BF16 (`kernels.swiglu_backward_dual`).

With BLOCK128, a tile's amax is reduced over all 256 threads and both passes use that one scale (the 128x128
weight groups; the transposed copy is W^T's).

The kernel is bound by the instructions it issues as much as by memory (BENCHMARKS.md: SASS counts
and the structures tried), so its hot path is kept short without changing a byte: the scale's division by 448 and
the group reciprocal run as the branch-free fast paths of __fdiv_rn / __frcp_rn; BF16 input divides with one
Markstein correction (checked exhaustively, `divide`); and the per-group fallbacks (NaN, inf, out-of-range scales)
are one uniform branch per pair of rows, and one per CTA for the columns (`fast_group`).

It runs when the layout allows the vector accesses (`takes`); any other input goes to the Triton kernels, which
give the same bytes. Compiled at first use with NVRTC (`torch.cuda._compile_kernel`, torch >= 2.8), in well
under a second: no toolkit headers, no build step.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

import torch

from megatron_jetrl.fp8.quant import E4M3

TILE = 128

_SOURCE = r"""
#define NAN_F __int_as_float(0x7fc00000)

__device__ __forceinline__ float nanmax(float m, float a) {   // max that keeps a NaN (PTX max.NaN, sm_80+)
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(a));
    return r;
}

// a / 448 correctly rounded, as __fdiv_rn(a, 448): for 2^-64 <= a <= 2^64 the three FMAs of its fast path with
// 1/448 rounded to FP32 (0x3b124925, what the compiler's refinement of the reciprocal gives), which is its result
// wherever its range check passes; elsewhere (inf, a tiny custom eps) the division itself. No branch on the hot path.
__device__ __forceinline__ float div448_fast(float a) {
    const float c = __int_as_float(0x3b124925), q = __fmul_rn(a, c);
    return __fmaf_rn(c, __fmaf_rn(q, -448.0f, a), q);
}

__device__ __forceinline__ float div448(float a) {
    if (!(a >= 0x1p-64f && a <= 0x1p+64f)) return __fdiv_rn(a, 448.0f);
    return div448_fast(a);
}

// UE8M0: a finite positive scale rounded up to a power of two.
__device__ __forceinline__ float ue8m0_up(float s) {
    const unsigned b = __float_as_uint(s);
    return __uint_as_float((((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u)) << 23);
}

__device__ __forceinline__ float scale_of(float amax, float eps) {
    if (amax != amax) return NAN_F;
    float s = div448(fmaxf(amax, eps));
#if UE8M0
    s = fmaxf(s, 1e-10f);
    if (((__float_as_uint(s) >> 23) & 0xFFu) != 0xFFu) s = ue8m0_up(s);  // inf stays visible
#endif
    return s;
}

// x / s, correctly rounded, for a group that shares s: y = RN(1/s) once per group, then per element
// q = RN(x*y) and FMA corrections q += (x - s*q)*y (Markstein; how many: below, at divide()), instead of a
// full-range division (reciprocal, range check, slow path) per element. Outside 2^-60 <= s <= 2^120 (NaN, inf,
// a tiny custom eps) the residual could under/overflow: such a group (recip() returns 0) takes the IEEE division,
// out of line, so that the hot loop stays small. The residual is formed negated, -RN(s*q - x) (= RN(x - s*q), round
// to nearest being symmetric), so that x = -0 keeps its sign through the corrections (-0 + -0 = -0, where x - s*q
// would give +0) with no copysign per element: the negations are free operand modifiers of the FMAs.
__device__ __forceinline__ float recip_fast(float s) {
    // __frcp_rn's fast path (its result for these exponents): MUFU.RCP, then one Newton step y0 + y0 (1 - s y0)
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(s));
    return __fmaf_rn(y0, -__fmaf_rn(y0, s, -1.0f), y0);
}

__device__ __forceinline__ float recip(float s) {
    const float y = recip_fast(s);
    return (s >= 0x1p-60f && s <= 0x1p+120f) ? y : 0.0f;
}

// Whether a group of amax `amax` is inside the range where scale_of and recip take no branch: max(amax, eps) in
// [2^-50, 2^64] (so s = that / 448, rounded up to a power of two with UE8M0, lies in [2^-60, 2^120]); false for NaN
// and inf. A warp (rows) or a CTA (columns, 128x128 tiles) whose groups all are quantizes them with no per-group
// branch (quantize8<false>), the others take the checked path: the same bytes either way.
__device__ __forceinline__ bool fast_group(float amax, float eps) {
    return fmaxf(amax, eps) >= 0x1p-50f && amax <= 0x1p+64f;
}

__device__ __forceinline__ float fast_scale(float amax, float eps) {  // scale_of for a fast_group: no branch
    const float s = div448_fast(fmaxf(amax, eps));
#if UE8M0
    return ue8m0_up(fmaxf(s, 1e-10f));
#else
    return s;
#endif
}

// BF16 input (8 significant bits) needs only the first correction: with y = RN(1/s), q = RN(x*y) corrected once is
// RN(x/s) for every pair of an 8-bit and a 24-bit significand, which tests/gpu/test_kernels.py checks exhaustively
// (2^30 pairs: the quotient of any other exponents is the same up to an exact power of two; below the FP32 normal
// range every quotient rounds to an E4M3 zero of x's sign anyway). E4M3 input dequantizes to 24-bit values, for
// which no such check exists: it keeps both corrections (CORRECTIONS).
#ifndef CORRECTIONS
#define CORRECTIONS (FP8_IN ? 2 : 1)
#endif
__device__ __forceinline__ float divide(float x, float s, float y) {
    float q = __fmul_rn(x, y);
    q = __fmaf_rn(-__fmaf_rn(s, q, -x), y, q);
#if CORRECTIONS > 1
    q = __fmaf_rn(-__fmaf_rn(s, q, -x), y, q);
#endif
    return q;
}

// tests/gpu: divide() against __fdiv_rn for x = 1 + m/128 (every 8-bit significand) and s = 1 + k / 2^23 (every
// 24-bit significand, one per thread); counts the pairs that differ and keeps the first s that does.
extern "C" __global__ void check_divide(unsigned long long* bad, unsigned* first_s) {
    const unsigned k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (1u << 23)) return;
    const float s = __uint_as_float(0x3f800000u | k), y = recip(s);
    unsigned n = 0;
    for (unsigned m = 0; m < 128; ++m) {
        const float x = __uint_as_float(0x3f800000u | (m << 16));
        n += __float_as_uint(divide(x, s, y)) != __float_as_uint(__fdiv_rn(x, s));
    }
    if (n) {
        atomicAdd(bad, (unsigned long long)n);
        atomicMin(first_s, k);
    }
}

__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {  // satfinite: +-448 at most, NaN stays NaN
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned pack4(float a, float b, float c, float d) {  // a -> lowest byte
    return e4m3x2(a, b) | ((unsigned)e4m3x2(c, d) << 16);
}

__device__ __noinline__ uint2 quantize8_ieee(float a, float b, float c, float d, float e, float f, float g, float h, float s) {
    return make_uint2(pack4(__fdiv_rn(a, s), __fdiv_rn(b, s), __fdiv_rn(c, s), __fdiv_rn(d, s)),
                      pack4(__fdiv_rn(e, s), __fdiv_rn(f, s), __fdiv_rn(g, s), __fdiv_rn(h, s)));
}

// The 8 bytes of 8 values of one group (scale s, y = recip(s)). CHECKED: a group whose y is 0 takes the IEEE division;
// unchecked, the caller has established that no group it quantizes needs it (fast_group), and no branch is left.
template <bool CHECKED = true>
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], float s, float y) {
    if (CHECKED && y == 0.0f) return quantize8_ieee(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], s);
    return make_uint2(pack4(divide(v[0], s, y), divide(v[1], s, y), divide(v[2], s, y), divide(v[3], s, y)),
                      pack4(divide(v[4], s, y), divide(v[5], s, y), divide(v[6], s, y), divide(v[7], s, y)));
}

__device__ __forceinline__ void e4m3x2_to_f32(unsigned short two, float& lo, float& hi) {  // exact
    unsigned h2;
    unsigned short l16, h16;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    l16 = (unsigned short)(h2 & 0xFFFFu);
    h16 = (unsigned short)(h2 >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l16));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h16));
}

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ unsigned bf16_rn(float x) {  // round to nearest even; NaN stays NaN
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// d[gate] | d[up] << 16 (BF16 bits) of silu(g) * u for the output gradient dy: the operations and roundings of
// kernels._swiglu_bwd, i.e. of torch's autograd of F.silu(gate) * up (MulBackward, then SiluBackward in FP32 opmath).
// `1.0f + expf(-g)` is left to the compiler as torch's own CUDA kernel leaves it.
__device__ __forceinline__ unsigned swiglu_grad(float g, float u, float dy) {
    const float e = 1.0f + expf(-g);
    const float act = __uint_as_float(bf16_rn(__fdiv_rn(g, e)) << 16);          // F.silu(gate), BF16
    const unsigned du = bf16_rn(__fmul_rn(dy, act));                              // d_up = dy * silu(gate)
    const float t = __uint_as_float(bf16_rn(__fmul_rn(dy, u)) << 16);            // dy * up, BF16
    const float sig = __fdiv_rn(1.0f, e);
    const unsigned dg = bf16_rn(__fmul_rn(__fmul_rn(t, sig), __fmaf_rn(g, __fsub_rn(1.0f, sig), 1.0f)));
    return dg | (du << 16);
}

// tests/gpu: swiglu_grad for every (g, u, dy) of three BF16 arrays, as d[gate] | d[up] << 16.
extern "C" __global__ void check_swiglu(const unsigned short* g, const unsigned short* u, const unsigned short* dy,
                                        unsigned* out, int n) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) out[k] = swiglu_grad(__uint_as_float((unsigned)g[k] << 16), __uint_as_float((unsigned)u[k] << 16),
                                    __uint_as_float((unsigned)dy[k] << 16));
}

// A 1x128 group's amax: this thread's 8 values, reduced over the 16 threads of its half-warp.
__device__ __forceinline__ float half_warp_amax(const float (&row)[8]) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = nanmax(m, fabsf(row[j]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// Row t's group that starts at n0, of amax m: this thread's 8 bytes (features n..n+7) and (the half-warp's first
// thread) the group's scale.
template <bool CHECKED>
__device__ __forceinline__ void store_row(
    const float (&row)[8], float m, int t, int n, int n0, int T, int N, float eps,
    unsigned char* __restrict__ q, float* __restrict__ s, int ldq, int s_t, int s_n)
{
    const float sr = CHECKED ? scale_of(m, eps) : fast_scale(m, eps);
    const float yr = CHECKED ? recip(sr) : recip_fast(sr);
    if (n < N && t < T) {
        *reinterpret_cast<uint2*>(q + (long long)t * ldq + n) = quantize8<CHECKED>(row, sr, yr);
        if ((threadIdx.x & 15) == 0) s[(long long)t * s_t + (long long)(n0 >> 7) * s_n] = sr;
    }
}

// This thread's 8 columns of a tile into the shared transposed tile: each column's 8 bytes are 8 consecutive tokens
// of one row of the transposed output (16-byte chunks XOR-swizzled by row / 8).
template <bool CHECKED, class Values>
__device__ __forceinline__ void cols_to_tile(Values v, unsigned char* tile, const float* col_scale, const float* col_recip) {
    const int c = threadIdx.x & 15, r = threadIdx.x >> 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float col[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) col[i] = v(i, j);
        const int row = 8 * c + j;                      // feature within the tile: a row of the transposed output
        const int chunk = (r >> 1) ^ (c & 7);           // 16-byte chunk holding tokens 8r..8r+7
        *reinterpret_cast<uint2*>(tile + row * 128 + chunk * 16 + (r & 1) * 8) = quantize8<CHECKED>(col, col_scale[row], col_recip[row]);
    }
}

// The row (ROWS) and transposed column (COLS) passes of the module docstring over one 128 (tokens) x 128 (features)
// tile of a [T, N] tensor whose features start at n0; v(i, j) is this thread's value at tile row 8r+i, column 8c+j.
// Both kernels run it; a kernel that runs it twice syncs in between (it reuses `sh`).
struct TileShared {                                   // the column pass's shared memory (21 KiB)
    __align__(16) unsigned char tile[128 * 128];      // the transposed bytes, swizzled
    float red[8][128];                                // per-warp column amax
    float col_scale[128], col_recip[128];
};

template <class Values>
__device__ __forceinline__ void quantize_tile(
    Values v, TileShared& sh, int bt, int n0, int T, int N, float eps,
    unsigned char* __restrict__ q, float* __restrict__ s, unsigned char* __restrict__ qt, float* __restrict__ st,
    int ldq, int s_t, int s_n, int ldqt, int st_n, int st_t)
{
    float (*red)[128] = sh.red;
    float *col_scale = sh.col_scale, *col_recip = sh.col_recip;
    unsigned char* tile = sh.tile;
    const int tid = threadIdx.x, c = tid & 15, r = tid >> 4, warp = tid >> 5, t0 = bt * 128;
    const int n = n0 + 8 * c;
#if BLOCK128
    float block_amax;
    {   // one scale for the whole tile (the weights' 128x128 groups): amax over the thread, the warp, the 8 warps
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) m = nanmax(m, fabsf(v(i, j)));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
        if ((tid & 31) == 0) red[0][warp] = m;
        __syncthreads();
        m = red[0][0];
#pragma unroll
        for (int w = 1; w < 8; ++w) m = nanmax(m, red[0][w]);
        block_amax = m;
        const float sc = scale_of(m, eps);
        if (tid < 128) { col_scale[tid] = sc; col_recip[tid] = recip(sc); }
        if (tid == 0) {
            s[(long long)bt * s_t + (long long)(n0 >> 7) * s_n] = sc;
#if COLS
            st[(long long)(n0 >> 7) * st_n + (long long)bt * st_t] = sc;
#endif
        }
        __syncthreads();
    }
#endif
#if ROWS
#if BLOCK128
    const bool fast = fast_group(block_amax, eps);  // the tile's one scale (uniform across the CTA)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int t = t0 + 8 * r + i;
        float row[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) row[j] = v(i, j);
        if (n < N && t < T)
            *reinterpret_cast<uint2*>(q + (long long)t * ldq + n) =
                fast ? quantize8<false>(row, col_scale[0], col_recip[0]) : quantize8<true>(row, col_scale[0], col_recip[0]);
    }
#else
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float row[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) row[j] = v(i, j);
        const float m = half_warp_amax(row);
        if (__all_sync(0xffffffffu, fast_group(m, eps))) store_row<false>(row, m, t0 + 8 * r + i, n, n0, T, N, eps, q, s, ldq, s_t, s_n);
        else store_row<true>(row, m, t0 + 8 * r + i, n, n0, T, N, eps, q, s, ldq, s_t, s_n);
    }
#endif
#endif
#if COLS
#if !BLOCK128
    float col_amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) m = nanmax(m, fabsf(v(i, j)));
        m = nanmax(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if ((tid & 16) == 0) red[warp][8 * c + j] = m;
    }
    __syncthreads();
    if (tid < 128) {
        float m = red[0][tid];
#pragma unroll
        for (int w = 1; w < 8; ++w) m = nanmax(m, red[w][tid]);
        col_amax = m;
        const float sc = scale_of(m, eps);
        col_scale[tid] = sc;
        col_recip[tid] = recip(sc);
        if (n0 + tid < N) st[(long long)(n0 + tid) * st_n + (long long)bt * st_t] = sc;
    }
    const bool fast_cols = !__syncthreads_or(tid < 128 && !fast_group(col_amax, eps));
#else
    const bool fast_cols = fast_group(block_amax, eps);
#endif
    if (fast_cols) cols_to_tile<false>(v, tile, col_scale, col_recip);
    else cols_to_tile<true>(v, tile, col_scale, col_recip);
    __syncthreads();
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
        const int row = (tid >> 3) + 32 * k4, k = tid & 7;
        const int t = t0 + 16 * k;
        if (n0 + row < N && t < T) {
            const uint4 chunk = *reinterpret_cast<const uint4*>(tile + row * 128 + ((k ^ ((row >> 3) & 7)) * 16));
            *reinterpret_cast<uint4*>(qt + (long long)(n0 + row) * ldqt + t) = chunk;
        }
    }
#endif
}

// d[gate | up] of silu(gate) * up, quantized without being stored: one CTA reads tokens t0..t0+127 of gate, up
// (columns f0.. and I + f0.. of gu [T, 2I]) and dy [T, I], computes both gradients once per (token, feature) as BF16
// pairs, and writes the rows and transposed columns of the d[gate] tile (features f0..) and of the d[up] tile
// (features I + f0..) of the [T, 2I] gradient. d[gate] stays in registers while d[up] waits, half in registers and
// half in shared memory (word w of thread tid at up_smem[w][tid]: no bank conflicts), so that nothing spills and
// the static shared memory stays under 48 KiB. Arguments in quant_tile's order: dy in xs's place, its row stride
// in xs_t; N = I, a multiple of 128 (a tile never straddles gate and up).
extern "C" __global__ void __launch_bounds__(256, 2) swiglu_bwd_tile(
    const unsigned char* __restrict__ gu, const unsigned char* __restrict__ dy,
    unsigned char* __restrict__ q, float* __restrict__ s,
    unsigned char* __restrict__ qt, float* __restrict__ st,
    int T, int I, int ldgu, int lddy, int unused, int ldq, int s_t, int s_n, int ldqt, int st_n, int st_t, int eps_bits)
{
    __shared__ TileShared sh;
    __shared__ unsigned up_smem[16][256];
    const float eps = __int_as_float(eps_bits);
    const int tid = threadIdx.x, c = tid & 15, r = tid >> 4;
    const int t0 = blockIdx.x * 128, f0 = blockIdx.y * 128, f = f0 + 8 * c;
    unsigned p[8][4], up[4][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int t = t0 + 8 * r + i;
        const bool ok = t < T;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        const long long g_at = (long long)t * ldgu + f;
        const uint4 g4 = ok ? *reinterpret_cast<const uint4*>(gu + g_at * 2) : zero;
        const uint4 u4 = ok ? *reinterpret_cast<const uint4*>(gu + (g_at + I) * 2) : zero;
        const uint4 d4 = ok ? *reinterpret_cast<const uint4*>(dy + ((long long)t * lddy + f) * 2) : zero;
        const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w}, dw[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned lo = swiglu_grad(bf16_lo(gw[j]), bf16_lo(uw[j]), bf16_lo(dw[j]));
            const unsigned hi = swiglu_grad(bf16_hi(gw[j]), bf16_hi(uw[j]), bf16_hi(dw[j]));
            p[i][j] = (lo & 0xFFFFu) | (hi << 16);
            const unsigned u2 = (lo >> 16) | (hi & 0xFFFF0000u);
            if (i < 4) up[i][j] = u2;
            else up_smem[4 * (i - 4) + j][tid] = u2;
        }
    }
    auto packed = [&](int i, int j) { return j & 1 ? bf16_hi(p[i][j >> 1]) : bf16_lo(p[i][j >> 1]); };
    quantize_tile(packed, sh, blockIdx.x, f0, T, 2 * I, eps, q, s, qt, st, ldq, s_t, s_n, ldqt, st_n, st_t);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) p[i][j] = i < 4 ? up[i][j] : up_smem[4 * (i - 4) + j][tid];
#if COLS
    __syncthreads();  // the d[gate] tile's column pass is done with the shared memory
#endif
    quantize_tile(packed, sh, blockIdx.x, I + f0, T, 2 * I, eps, q, s, qt, st, ldq, s_t, s_n, ldqt, st_n, st_t);
}

// The 1x128 rows and/or 128x1 transposed columns (or, BLOCK128, the 128x128 tiles) of a [T, N] tensor (E4M3 input: its
// values q * s rounded to FP32, as dequantize_blockwise). One tile per CTA, numbered token tile fastest, so that
// neighbouring CTAs write neighbouring 128-byte pieces of the transposed rows; each thread issues all 8 of its row loads
// (and scale loads) before it converts any. Measured on an H200 against a persistent CTA with cp.async double
// buffering, one with register prefetch and one holding packed BF16 words: none was faster (BENCHMARKS.md).
extern "C" __global__ void __launch_bounds__(256, 3) quant_tile(
    const unsigned char* __restrict__ x, const float* __restrict__ xs,
    unsigned char* __restrict__ q, float* __restrict__ s,
    unsigned char* __restrict__ qt, float* __restrict__ st,
    int T, int N, int ldx, int xs_t, int xs_n, int ldq, int s_t, int s_n, int ldqt, int st_n, int st_t, int eps_bits)
{
    __shared__ TileShared sh;
    const int tid = threadIdx.x, c = tid & 15, r = tid >> 4;
    const int tiles_t = (T + 127) >> 7, bt = blockIdx.x % tiles_t, bn = blockIdx.x / tiles_t;
    const int n = bn * 128 + 8 * c;
#if FP8_IN
    uint2 raw[8];
    float sc[8];
#else
    uint4 raw[8];
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int t = bt * 128 + 8 * r + i;
        const bool ok = n < N && t < T;
        const long long at = ok ? (long long)t * ldx + n : 0;
#if FP8_IN
        raw[i] = ok ? *reinterpret_cast<const uint2*>(x + at) : make_uint2(0u, 0u);
        sc[i] = ok ? xs[(long long)t * xs_t + (long long)bn * xs_n] : 0.0f;
#else
        raw[i] = ok ? *reinterpret_cast<const uint4*>(x + at * 2) : make_uint4(0u, 0u, 0u, 0u);
#endif
    }
    float v[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#if FP8_IN
        const unsigned w[2] = {raw[i].x, raw[i].y};
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            e4m3x2_to_f32((unsigned short)(w[j >> 2] >> (8 * (j & 3))), v[i][j], v[i][j + 1]);
            v[i][j] = __fmul_rn(v[i][j], sc[i]);
            v[i][j + 1] = __fmul_rn(v[i][j + 1], sc[i]);
        }
#else
        const unsigned w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = j & 1 ? bf16_hi(w[j >> 1]) : bf16_lo(w[j >> 1]);
#endif
    }
    quantize_tile([&](int i, int j) { return v[i][j]; }, sh, bt, bn * 128, T, N, __int_as_float(eps_bits),
                  q, s, qt, st, ldq, s_t, s_n, ldqt, st_n, st_t);
}
"""


def available() -> bool:
    """Whether this torch can compile the kernel (NVRTC through `torch.cuda._compile_kernel`, torch >= 2.8)."""
    return hasattr(torch.cuda, "_compile_kernel")


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernel.restype = ctypes.c_int
    return lib


_thread = threading.local()


def _make_context_current(device_index: int) -> None:
    """The driver API launches into the calling thread's current context. A thread that has made no CUDA runtime
    call yet (autograd's device thread runs the backward) has none: make the device's primary context current, the
    one torch and the compiled module live in."""
    if getattr(_thread, "device", None) == device_index:
        return
    lib, dev, primary, current = _libcuda(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    if lib.cuDeviceGet(ctypes.byref(dev), device_index) or lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev):
        raise RuntimeError(f"could not get the primary CUDA context of device {device_index} for the FP8 tile quantizer")
    if lib.cuCtxGetCurrent(ctypes.byref(current)) or current.value != primary.value:
        if lib.cuCtxSetCurrent(primary):
            raise RuntimeError(f"could not make the primary CUDA context of device {device_index} current")
    _thread.device = device_index


def source(fp8_in: bool, rows: bool, cols: bool, ue8m0: bool, block128: bool = False) -> str:
    """The CUDA source of one variant: its five switches as #defines, then `_SOURCE`."""
    flags = (("FP8_IN", fp8_in), ("ROWS", rows), ("COLS", cols), ("UE8M0", ue8m0), ("BLOCK128", block128))
    return "".join(f"#define {k} {int(v)}\n" for k, v in flags) + _SOURCE


@functools.cache
def _kernel(
    fp8_in: bool, rows: bool, cols: bool, ue8m0: bool, device_index: int, name: str = "quant_tile", block128: bool = False
):
    """The compiled kernel `name` (NVRTC through torch, once per variant and device); `.func` is its CUfunction."""
    with torch.cuda.device(device_index):
        kern = torch.cuda._compile_kernel(source(fp8_in, rows, cols, ue8m0, block128), name)
    if getattr(kern, "func", None) is None:
        raise RuntimeError(
            f"torch {torch.__version__}: torch.cuda._compile_kernel returned no CUfunction (.func); "
            "set megatron_jetrl.fp8.kernels.QUANT_CFG['dual']['mode'] = 'split' to use the Triton kernels"
        )
    return kern


class _Args:
    """The kernel's 18 arguments packed in one buffer (6 pointers, then 12 ints) with a fixed `void*[]` pointing into
    it: a launch rewrites the buffer with one `pack_into` (torch's generic launcher builds the arguments per call: ~60 us
    of host time, which the backward's small linears feel as launch gaps; 18 ctypes assignments were most of ours).
    One per thread (autograd runs the backward on its own thread); cuLaunchKernel copies the values."""

    PACK = struct.Struct("<6Q12i")

    def __init__(self):
        self.buffer = ctypes.create_string_buffer(self.PACK.size)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * 18)(*[base + 8 * i for i in range(6)], *[base + 48 + 4 * i for i in range(12)])

    def fill(self, pointers, ints):
        self.PACK.pack_into(self.buffer, 0, *pointers, *ints)
        return self.params


def _launch(func, device_index, grid, pointers, ints) -> None:
    """cuLaunchKernel of CTAs of 256 threads on torch's current stream."""
    _make_context_current(device_index)
    args = getattr(_thread, "args", None)
    if args is None:
        args = _thread.args = _Args()
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    err = _libcuda().cuLaunchKernel(func, grid[0], grid[1], 1, 256, 1, 1, 0, stream, args.fill(pointers, ints), None)
    if err:
        raise RuntimeError(f"cuLaunchKernel of the FP8 tile quantizer failed with CUDA error {err}")


def _aligned(t: torch.Tensor, elems: int) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) % elems == 0 and t.stride(-1) == 1


def takes(x: torch.Tensor, x_scale: torch.Tensor | None, cols: bool = True) -> bool:
    """Whether `quantize` handles this [T, N] input: BF16 (or E4M3 with its 1x128 scales), rows 16-byte aligned,
    N % 8 == 0 (whole vectors) and, when the transposed columns are written, T % 16 == 0 (whole 16-byte chunks of the
    transposed rows)."""
    if not available() or x.dim() != 2 or x.device.type != "cuda":
        return False
    t, n = x.shape
    if t == 0 or n == 0 or (cols and t % 16) or n % 8 or t >= 2**31 or n >= 2**31:
        return False
    if x.dtype == torch.bfloat16 and x_scale is None:
        return _aligned(x, 8)
    return x.dtype == E4M3 and x_scale is not None and _aligned(x, 8)


def quantize(x, x_scale, q, s, qt, st, eps: float, ue8m0: bool, block128: bool = False) -> None:
    """Fill the preallocated outputs of `kernels.quantize_dual` (q/s: 1x128 rows, qt/st: 128x1 transposed; either
    pair may be None) or, `block128`, of `kernels.quantize_128x128` (q/s: the 128x128 tiles; qt/st: those of x^T, or
    None). The caller checked `takes`; q, qt are contiguous, s/st any strides. One CTA per 128x128 tile."""
    t, n = x.shape
    fp8_in = x_scale is not None
    xs = x_scale if fp8_in else (s if q is not None else st)  # (not read without FP8 input)
    device_index = x.get_device()  # (a CUDA tensor: its device index, without building a device object)
    _make_context_current(device_index)  # before the first compile too: loading the module needs a current context
    kern = _kernel(fp8_in, q is not None, qt is not None, ue8m0, device_index, "quant_tile", block128)
    _launch(
        kern.func,
        device_index,
        (-(-t // TILE) * -(-n // TILE), 1),
        *_arguments(x, xs, [t, n, x.stride(0), xs.stride(0), xs.stride(1)], q, s, qt, st, eps),
    )


def _arguments(a, b, head: list[int], q, s, qt, st, eps: float):
    """(pointers, ints) of a launch: inputs `a`, `b`, the outputs (a missing pair repeats the other, never written),
    the first five integer arguments `head`, then the outputs' strides and eps: the order both kernels share."""
    rows, cols = q is not None, qt is not None
    q_, s_ = (q, s) if rows else (qt, st)
    qt_, st_ = (qt, st) if cols else (q, s)
    return (
        [a.data_ptr(), b.data_ptr(), q_.data_ptr(), s_.data_ptr(), qt_.data_ptr(), st_.data_ptr()],
        [*head, q_.stride(0), s_.stride(0), s_.stride(1), qt_.stride(0), st_.stride(0), st_.stride(1), _float_bits(eps)],
    )


@functools.lru_cache(maxsize=8)
def _float_bits(x: float) -> int:
    """The FP32 bit pattern of `x` as an int (the kernel takes eps as bits: no float rounding in the launch path)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def takes_swiglu(gate_up: torch.Tensor, d_out: torch.Tensor) -> bool:
    """Whether `quantize_swiglu_backward` handles gate_up [T, 2I] and d_out [T, I]: both BF16 with 16-byte aligned
    rows, I % 128 == 0 (a tile never straddles gate and up) and T % 16 == 0 (whole chunks of the transposed rows)."""
    if not available() or gate_up.dim() != 2 or d_out.dim() != 2 or gate_up.device.type != "cuda":
        return False
    t, i = d_out.shape
    if tuple(gate_up.shape) != (t, 2 * i) or t == 0 or i == 0 or t % 16 or i % TILE or t >= 2**31 or 2 * i >= 2**31:
        return False
    return (
        gate_up.dtype == d_out.dtype == torch.bfloat16
        and gate_up.device == d_out.device
        and _aligned(gate_up, 8)
        and _aligned(d_out, 8)
    )


def quantize_swiglu_backward(gate_up, d_out, q, s, qt, st, eps: float, ue8m0: bool) -> None:
    """Fill `quantize`'s outputs for d[gate | up] `[T, 2I]`, the gradient of silu(gate) * up for `d_out`, without
    storing it (the `swiglu_bwd_tile` kernel). The caller checked `takes_swiglu`; either output pair may be None."""
    t, i = d_out.shape
    device_index = gate_up.get_device()
    _make_context_current(device_index)
    kern = _kernel(False, q is not None, qt is not None, ue8m0, device_index, "swiglu_bwd_tile")
    _launch(
        kern.func,
        device_index,
        (-(-t // TILE), i // TILE),
        *_arguments(gate_up, d_out, [t, i, gate_up.stride(0), d_out.stride(0), 0], q, s, qt, st, eps),
    )
