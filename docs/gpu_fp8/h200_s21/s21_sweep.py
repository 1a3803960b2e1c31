"""SwiGLU + 1x128 Triton quantizer: launch settings (BLOCK_M, groups/program, warps) on [16384, 2*8192] -> % of copy."""
import torch, triton
from megatron_jetrl.fp8 import kernels as K
dev = "cuda"
t_, n_ = 16384, 8192
gu = torch.randn(t_, 2 * n_, device=dev, dtype=torch.bfloat16)
src = torch.empty(1 << 30, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200)
copy_gbs = 2 * src.numel() / copy_ms / 1e6
nbytes = t_ * n_ * 5 + t_ * (n_ // 128) * 4
q0, s0 = K.swiglu_quantize_1x128(gu, check_finite=False)
print(f"copy {copy_gbs:.0f} GB/s; default {K.QUANT_CFG['1x128']}")
rows = []
for bm in (1, 2, 4, 8, 16, 32, 64):
    for gr in (1, 2, 4):
        for wp in (1, 2, 4, 8, 16):
            if bm * gr * 128 > 16384 or bm * gr * 128 < 32 * wp:
                continue
            try:
                q, s = K.swiglu_quantize_1x128(gu, check_finite=False, block_m=bm, groups=gr, num_warps=wp)
                ok = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
                ms = triton.testing.do_bench(lambda: K.swiglu_quantize_1x128(gu, check_finite=False, block_m=bm, groups=gr, num_warps=wp), rep=100)
            except Exception as e:
                print(f"bm={bm} g={gr} w={wp}: {type(e).__name__} {str(e)[:80]}"); continue
            pct = 100 * nbytes / ms / 1e6 / copy_gbs
            rows.append((pct, bm, gr, wp, ms * 1e3, ok))
for pct, bm, gr, wp, us, ok in sorted(rows, reverse=True)[:12]:
    print(f"  bm={bm:3d} g={gr} warps={wp:2d}  {us:7.1f} us  {pct:5.1f}% of copy  bytes equal: {ok}")
