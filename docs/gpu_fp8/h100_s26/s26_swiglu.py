"""SwiGLU backward + dual quantization: split (two kernels) vs the paired CUDA kernel vs a CTA per tile (2 or 3 per SM),
at the megatron layer's shape (32768 tokens, I = 12288) and bench_fp8's (16384, 8192). Bytes: the fused kernel's
(read gate_up + d_out, write rows + transposed cols + scales). Also checks bytes against split at the big shape."""
import torch
from triton.testing import do_bench
from megatron_jetrl.fp8 import kernels as K

dev = "cuda"
src = torch.empty(1 << 28, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
copy = 2 * src.numel() / do_bench(lambda: dst.copy_(src), rep=200) / 1e6
print(f"copy {copy:.0f} GB/s", flush=True)
for t, i in ((32768, 12288), (16384, 8192)):
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(t, 2 * i, device=dev, generator=g).to(torch.bfloat16)
    dy = (torch.randn(t, i, device=dev, generator=g) * 1e-2).to(torch.bfloat16)
    nbytes = t * i * 10 + (t * 2 * i // 128 + 2 * i * t // 128) * 4
    ref = K.swiglu_backward_dual(gu, dy, mode="split")
    for mode in ("split", "cuda", "cuda-half", "cuda-half3"):
        out = K.swiglu_backward_dual(gu, dy, mode=mode)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(out, ref))
        ms = do_bench(lambda: K.swiglu_backward_dual(gu, dy, mode=mode), rep=300)
        gbs = nbytes / ms / 1e6
        print(f"T={t} I={i} {mode:11s} {ms*1e3:8.1f} us  {gbs:6.0f} GB/s of the fused bytes  {100*gbs/copy:5.1f}% of copy  same={same}", flush=True)
    del gu, dy, ref
