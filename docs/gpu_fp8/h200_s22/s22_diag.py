"""Session 22 call A: where the FP8 linear's backward host time goes (body vs autograd engine), M=256, o shape."""
import cProfile, io, pstats, sys, threading, time
import torch
from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, finite
from megatron_jetrl.fp8 import linear as L

dev, m, n, k = torch.device("cuda"), 256, 4096, 4096
flow = PrecisionFlow(mode="jetrl")
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
lin = FP8Linear(k, n, bias=False, flow=flow, device=dev, dtype=torch.bfloat16)
lin.weight.main_grad = torch.zeros(n, k, device=dev, dtype=torch.float32)
lin.weight.grad_added_to_main_grad = False
bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)

body = []
orig = L._FP8LinearFunction.backward
profs = {}
PROFILE = [False]
def timed_backward(ctx, dy_):
    if PROFILE[0]:
        p = profs.setdefault(threading.get_ident(), cProfile.Profile())
        p.enable()
    t = time.perf_counter()
    out = orig(ctx, dy_)
    body.append(time.perf_counter() - t)
    if PROFILE[0]:
        p.disable()
    return out
L._FP8LinearFunction.backward = staticmethod(timed_backward)

class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, a, f, s, act, h):
        ctx.save_for_backward(x)
        return torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    @staticmethod
    def backward(ctx, d):
        (x,) = ctx.saved_tensors
        return torch.empty_like(x), None, None, None, None, None, None, None

def host(fn, iters=200):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6

w_nograd = torch.nn.Parameter(lin.weight.detach().clone())
rows = {}
def fp8_fwd_bwd():
    lin(x).backward(dy)
def fp8_fwd_only():
    lin(x)
def fp8_split():
    y = lin(x)
    t = time.perf_counter()
    y.backward(dy)
    bwd_outer.append(time.perf_counter() - t)
def bf16_fwd_bwd():
    bf16(x).backward(dy)
def bf16_split():
    y = bf16(x)
    t = time.perf_counter()
    y.backward(dy)
    bf_outer.append(time.perf_counter() - t)
def trivial_fwd_bwd():
    Trivial.apply(x, w_nograd, None, None, flow, "s", None, None).backward(dy)

for r in range(3):
    bwd_outer, bf_outer = [], []
    body.clear()
    res = {
        "bf16 fwd+bwd": host(bf16_fwd_bwd),
        "fp8 fwd+bwd": host(fp8_fwd_bwd),
        "fp8 fwd": host(fp8_fwd_only),
        "trivial Function fwd+bwd": host(trivial_fwd_bwd),
    }
    body.clear()
    res["fp8 fwd+bwd (split)"] = host(fp8_split)
    res["fp8 y.backward() outer"] = sum(bwd_outer[5:]) / len(bwd_outer[5:]) * 1e6
    res["fp8 Function.backward body"] = sum(body[5:]) / len(body[5:]) * 1e6
    res["bf16 (split)"] = host(bf16_split)
    res["bf16 y.backward() outer"] = sum(bf_outer[5:]) / len(bf_outer[5:]) * 1e6
    print(f"round {r}: " + "; ".join(f"{k_} {v:.1f}" for k_, v in res.items()), flush=True)

PROFILE[0] = True
for _ in range(200): fp8_fwd_bwd()
torch.cuda.synchronize()
for tid, p in profs.items():
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(25)
    print(f"--- backward thread {tid} (200 calls) ---\n" + s.getvalue()[:6000])
p = cProfile.Profile()
p.enable()
for _ in range(200): fp8_fwd_only()
p.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(25)
print("--- forward, main thread (200 calls) ---\n" + s.getvalue()[:6000])
