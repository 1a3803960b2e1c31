"""Session 22: host us per FP8Linear fwd+bwd (o shape, M=256) under GC variants; optional torch.profiler CPU table."""
import gc, json, statistics, sys, time
import torch
from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, finite

variant = sys.argv[1] if len(sys.argv) > 1 else "default"
dev, m, n, k = torch.device("cuda"), 256, 4096, 4096
flow = PrecisionFlow(mode="jetrl")
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
lin = FP8Linear(k, n, bias=False, flow=flow, device=dev, dtype=torch.bfloat16)
lin.weight.main_grad = torch.zeros(n, k, device=dev, dtype=torch.float32)
lin.weight.grad_added_to_main_grad = False
bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
for _ in range(10):
    lin(x).backward(dy); bf16(x).backward(dy)
torch.cuda.synchronize()
if variant == "freeze":
    gc.collect(); gc.freeze()
elif variant == "disable":
    gc.collect(); gc.disable()

def host(fn, iters=150):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6

def fp8():
    lin(x).backward(dy)
def fp8_watch():
    with finite.watch():
        lin(x).backward(dy)
def fwd():
    lin(x)
def bf():
    bf16(x).backward(dy)
res = {name: [] for name in ("bf16", "fp8", "fp8_watch", "fp8_fwd")}
for _ in range(5):
    res["bf16"].append(host(bf)); res["fp8"].append(host(fp8)); res["fp8_watch"].append(host(fp8_watch)); res["fp8_fwd"].append(host(fwd))
print(json.dumps({"variant": variant, **{k_: round(statistics.median(v), 1) for k_, v in res.items()}}), flush=True)
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            fp8()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
