"""Host time inside one FP8Linear fwd+bwd (M=256, N=K=4096; GPU never the bottleneck): inclusive host us per call of
each helper of fp8/linear.py, fp8/gemm.py, fp8/kernels.py, fp8/cuda_tiles.py, beside the whole."""
import collections, time, sys, torch
from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, finite, linear, gemm, kernels, cuda_tiles, backends

dev = torch.device("cuda")
m = int(sys.argv[1]) if len(sys.argv) > 1 else 256
n = k = 4096
lin = FP8Linear(k, n, bias=False, flow=PrecisionFlow(mode="jetrl"), device=dev, dtype=torch.bfloat16)
lin.weight.main_grad = torch.zeros(n, k, device=dev)
lin.weight.grad_added_to_main_grad = False
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
acc = collections.defaultdict(lambda: [0.0, 0])

def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **kw):
        t = time.perf_counter_ns()
        try:
            return f(*a, **kw)
        finally:
            r = acc[f"{mod.__name__.split('.')[-1]}.{name}"]; r[0] += time.perf_counter_ns() - t; r[1] += 1
    setattr(mod, name, w)

def step():
    with finite.watch():
        y = lin(x)
        t = time.perf_counter_ns(); y.backward(dy); r = acc["y.backward (engine + Function.backward)"]; r[0] += time.perf_counter_ns() - t; r[1] += 1
        x.grad = None; lin.weight.grad = None

for _ in range(20):
    step()
torch.cuda.synchronize()
iters = 300
t0 = time.perf_counter_ns()
for _ in range(iters):
    step()
plain = (time.perf_counter_ns() - t0) / iters / 1e3
torch.cuda.synchronize()
acc.clear()
for mod, names in [(linear, ["_quantize_input", "_fprop", "_quantize_grad", "_requantize_tokens", "_record", "_wgrad_done", "_fast", "blockwise_gemm", "fp8_linear"]),
                   (linear.QuantizedWeight, ["transposed"]), (linear.FP8Linear, ["quantized_weight"]),
                   (kernels, ["quantize", "quantize_1x128", "quantize_dual"]), (cuda_tiles, ["quantize", "_launch", "takes"]),
                   (gemm, ["_check_operands", "resolve_backend"]), (backends, ["gemm_deepgemm"]), (finite.FiniteWatch, ["record"]),
                   (linear._FP8LinearFunction, [])]:
    for nm in names:
        if hasattr(mod, nm):
            if isinstance(mod, type):
                f = getattr(mod, nm)
                def mk(f=f, key=f"{mod.__name__}.{nm}"):
                    def w(*a, **kw):
                        t = time.perf_counter_ns()
                        try:
                            return f(*a, **kw)
                        finally:
                            r = acc[key]; r[0] += time.perf_counter_ns() - t; r[1] += 1
                    return w
                setattr(mod, nm, mk())
            else:
                wrap(mod, nm)
for _ in range(20):
    step()
torch.cuda.synchronize(); acc.clear()
t0 = time.perf_counter_ns()
for _ in range(iters):
    step()
wrapped = (time.perf_counter_ns() - t0) / iters / 1e3
torch.cuda.synchronize()
print(f"M={m}: FP8Linear fwd+bwd in a watch, host us per call: {plain:.1f} unwrapped, {wrapped:.1f} wrapped")
for key, (ns, c) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
    print(f"  {key:48s} {ns / iters / 1e3:8.1f} us per fwd+bwd  ({c / iters:.1f} calls, {ns / c / 1e3:6.1f} us each)")
