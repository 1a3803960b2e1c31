# Session 25 call A: torch SDPA backends for the local spec's causal GQA attention at Qwen3-8B heads (32 q, 8 kv,
# d 128), fwd+bwd, laid out as SDPAttention lays them out (permuted [s, b, h, d] views). Which does the default pick,
# and is cuDNN's faster? Also the max |diff| of out and grads against FLASH.
import torch, torch.nn.functional as F, time, json, sys
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
res = {}
def make(b, s):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(s, b, 32, 128, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(s, b, 8, 128, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(s, b, 8, 128, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(b, 32, s, 128, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v, do

def run(q, k, v, do, backends, expand=False):
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if expand:
        kk, vv = kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1)
    ctx = sdpa_kernel(backends) if backends else torch.enable_grad()
    with ctx:
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=not expand)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), do)
    return out, gq, gk, gv

VARIANTS = {"default": (None, False), "flash": ([SDPBackend.FLASH_ATTENTION], False),
            "cudnn": ([SDPBackend.CUDNN_ATTENTION], False), "cudnn-expanded": ([SDPBackend.CUDNN_ATTENTION], True),
            "efficient": ([SDPBackend.EFFICIENT_ATTENTION], False),
            "cudnn>flash": ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], False)}
for b, s in ((8, 4096), (4, 8192), (1, 4096)):
    q, k, v, do = make(b, s)
    ref = run(q, k, v, do, [SDPBackend.FLASH_ATTENTION])
    flops = 4 * b * 32 * s * s * 128 / 2 * 3.5  # causal fwd (2 GEMMs) + bwd (5 GEMMs)
    row = {}
    for name, (bk, ex) in VARIANTS.items():
        try:
            outs = run(q, k, v, do, bk, ex)
            diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(outs, ref))
            for _ in range(2):
                run(q, k, v, do, bk, ex)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            n = 10
            for _ in range(n):
                run(q, k, v, do, bk, ex)
            e1.record(); torch.cuda.synchronize()
            ms = e0.elapsed_time(e1) / n
            row[name] = dict(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), max_diff_vs_flash=diff)
        except Exception as e:  # noqa
            row[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        print(f"b={b} s={s} {name:15s} {row[name]}", flush=True)
    res[f"{b}x{s}"] = row
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "attn.json", "w"), indent=1)
