"""Where the Triton SwiGLU-fused quantizer differs from quantize_blockwise(F.silu(gate) * up) on adversarial groups."""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "tests/gpu")
from test_kernels import adversarial, gen, DEV
from megatron_jetrl.fp8 import kernels as k, quantize_blockwise
for mode in ("fp32", "ue8m0"):
  for i, (m, n) in enumerate([(64, 256), (100, 384), (1040, 1536)]):
    up = adversarial(m, n, torch.bfloat16, 950 + i)
    gate = torch.randn(m, n, device=DEV, generator=gen(960 + i)).mul(3).to(torch.bfloat16)
    gu = torch.cat([gate, up], dim=1)
    q, s = k.swiglu_quantize_1x128(gu, mode)
    h = F.silu(gate) * up
    rq, rs = quantize_blockwise(h, (1, 128), mode)
    dq = (q.view(torch.uint8) != rq.view(torch.uint8)).nonzero()
    ds = (s.contiguous().view(torch.int32) != rs.contiguous().view(torch.int32)).nonzero()
    print(mode, (m, n), "bytes differ:", dq.shape[0], "scales differ:", ds.shape[0], flush=True)
    for r, c in ds[:4].tolist():
        g = slice(c * 128, c * 128 + 128)
        print("  scale", (r, c), "got", s[r, c].item(), "want", rs[r, c].item(), "amax h", h[r, g].float().abs().max().item(),
              "amax recomputed", (F.silu(gate[r, g].float()).bfloat16().float() * up[r, g].float()).bfloat16().float().abs().max().item())
    for r, c in dq[:6].tolist():
        g = gate[r, c].float().item(); u = up[r, c].float().item()
        sil = F.silu(gate[r, c].float()).item()
        print("  byte", (r, c), "gate", g, "up", u, "silu32", sil, "silu_bf16", F.silu(gate[r:r+1, c:c+1]).float().item(),
              "h", h[r, c].float().item(), "got", q[r, c].float().item(), "want", rq[r, c].float().item(),
              "scale", s[r, c // 128].item(), rs[r, c // 128].item(), flush=True)
