# session 29 probe (issue 14): the WGrad GEMM (1D1D: both operands 1x128 along tokens, FP32 accumulate into main_grad)
# at the four Qwen3-8B linears' shapes, T = 8192 tokens. DeepGEMM 2.5.0 (default heuristic, tc_util and num_sms
# knobs) against the project's Triton kernel (plain, one-block lookahead, warp-specialized, other tiles), and
# cuBLASLt. Every variant is checked against DeepGEMM (and DeepGEMM against the FP64 reference on a corner) first.
# Timing: CUDA events over 20 back-to-back calls, 5 rounds interleaved across variants, median round.
import os, sys, json, statistics, time
import torch

sys.path.insert(0, os.getcwd())
from megatron_jetrl.fp8 import backends, kernels

torch.manual_seed(0)
dev = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
T = 8192
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
dg = backends.deep_gemm_module()
print(torch.cuda.get_device_name(), torch.__version__, "DeepGEMM", getattr(dg, "__version__", "?"), flush=True)


def operands(n, k):
    a = (torch.randn(n, T, device=dev) * 2).to(E4M3)  # dY^T [N, T]
    b = (torch.randn(k, T, device=dev) * 2).to(E4M3)  # X^T [K, T]
    sa = (torch.rand(T // 128, n, device=dev) + 0.5).t()  # [N, T/128], strides (1, N): the quantizers' layout
    sb = (torch.rand(T // 128, k, device=dev) + 0.5).t()
    return a, sa, b, sb


def run_dg(a, sa, b, sb, d, tc=None, sms=None):
    if tc is not None:
        dg.set_tc_util(tc)
    if sms is not None:
        dg.set_num_sms(sms)
    try:
        dg.fp8_gemm_nt((a, sa), (b, sb), d, c=d, recipe=(1, 1, 128), compiled_dims="mn", disable_ue8m0_cast=True)
    finally:
        if tc is not None:
            dg.set_tc_util(100)
        if sms is not None:
            dg.set_num_sms(torch.cuda.get_device_properties(dev).multi_processor_count)


TRITON = {
    "tri_base": (128, 128, 8, 8, 4, True),
    "tri_la4": (128, 128, 8, 8, 4, True, True),
    "tri_la3": (128, 128, 8, 8, 3, True, True),
    "tri_ws": (128, 128, 8, 8, 4, True, False, True),
    "tri_64x256": (64, 256, 8, 4, 4, True),
    "tri_128x64_la": (128, 64, 8, 4, 5, True, True),
    "tri_256x128": (256, 128, 8, 8, 3, True),
}


def variants():
    v = {"dg": lambda a, sa, b, sb, d: run_dg(a, sa, b, sb, d)}
    for tc in (90, 75, 50):
        v[f"dg_tc{tc}"] = (lambda tc: lambda a, sa, b, sb, d: run_dg(a, sa, b, sb, d, tc=tc))(tc)
    for sms in (128, 120):
        v[f"dg_sms{sms}"] = (lambda sms: lambda a, sa, b, sb, d: run_dg(a, sa, b, sb, d, sms=sms))(sms)
    for name, cfg in TRITON.items():
        v[name] = (lambda cfg: lambda a, sa, b, sb, d: kernels.gemm(a, sa, b, sb, (1, 128), torch.float32, config=cfg, out=d, accumulate=True))(cfg)
    v["cublaslt"] = lambda a, sa, b, sb, d: backends.gemm_cublaslt(a, sa, b, sb, (1, 128), torch.float32, acc=d)
    return v


def timed(fn, reps=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


results = {}
for lin, (n, k) in SHAPES.items():
    a, sa, b, sb = operands(n, k)
    flops = 2 * n * k * T
    ref = torch.zeros(n, k, device=dev)
    run_dg(a, sa, b, sb, ref)
    # DeepGEMM against the FP64 reference on a 256 x 256 corner
    exact = backends.gemm_emulated(a[:256], sa[:256], b[:256], sb[:256], (1, 128), torch.float64)
    dg_err = ((ref[:256, :256].double() - exact).norm() / exact.norm()).item()
    ok = {}
    for name, fn in variants().items():
        d = torch.zeros(n, k, device=dev)
        try:
            t0 = time.time()
            fn(a, sa, b, sb, d)
            torch.cuda.synchronize()
            first = time.time() - t0
            err = ((d - ref).norm() / ref.norm()).item()
            # accumulation: a second call on top of the first equals twice the product within FP32 rounding
            fn(a, sa, b, sb, d)
            acc_err = ((d - 2 * ref).norm() / (2 * ref).norm()).item()
            ok[name] = fn
            print(f"{lin:8s} {name:14s} first call {first:6.2f} s  rel err vs DeepGEMM {err:.2e}  accumulate {acc_err:.2e}", flush=True)
            if err > 1e-4 or acc_err > 1e-4:
                print(f"   ^ WRONG: dropped", flush=True)
                ok.pop(name)
        except Exception as ex:
            print(f"{lin:8s} {name:14s} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
    d = torch.zeros(n, k, device=dev)
    rounds = {name: [] for name in ok}
    for _ in range(5):
        for name, fn in ok.items():
            rounds[name].append(timed(lambda: fn(a, sa, b, sb, d)))
    # BF16 WGrad with megatron's fusion (FP32 main_grad += dY^T X) for the ratio
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    mg = torch.zeros(n, k, device=dev)
    try:
        bf = statistics.median(timed(lambda: torch.addmm(mg, ab, bb.t(), out_dtype=torch.float32)) for _ in range(5))
    except Exception as ex:
        print("bf16 addmm out_dtype failed", ex)
        bf = statistics.median(timed(lambda: mg.add_(torch.mm(ab, bb.t()))) for _ in range(5))
    row = {"bf16_ms": bf, "dg_fp64_err": dg_err}
    print(f"{lin} N={n} K={k} T={T}: bf16 (addmm into FP32) {bf:.3f} ms = {flops / bf / 1e9:.0f} TFLOP/s; DeepGEMM vs FP64 {dg_err:.1e}")
    for name, ts in rounds.items():
        ms = statistics.median(ts)
        row[name] = ms
        print(f"   {name:14s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  x{bf / ms:.2f} bf16  x{row.get('dg', ms) / ms:.2f} dg  spread {min(ts):.3f}-{max(ts):.3f}", flush=True)
    results[lin] = row
    del a, b, ref, d, ab, bb, mg
    torch.cuda.empty_cache()

print("\n| variant | " + " | ".join(SHAPES) + " | sum ms | vs dg |")
names = [n for n in results["qkv"] if n not in ("dg_fp64_err",)]
for name in names:
    if not all(name in r for r in results.values()):
        continue
    tot = sum(r[name] for r in results.values())
    dgt = sum(r["dg"] for r in results.values())
    print(f"| {name} | " + " | ".join(f"{r[name]:.3f}" for r in results.values()) + f" | {tot:.3f} | {dgt / tot:.2f}x |")
out = os.environ.get("OUT", "out")
os.makedirs(out, exist_ok=True)
json.dump(results, open(f"{out}/wgrad.json", "w"), indent=1)
