# session 29 probe (issue 14): DeepGEMM 2.5.0 with deep_gemm_2_5_0_wgrad_turns.py (beside this file; measured in
# call D from patches/, not shipped) (the two math warpgroups
# issue their WGMMAs in turn) against the unpatched kernels, one variant per process:
#   python3 .calls/s29_turns.py VARIANT OUT.json      VARIANT: orig | wgrad (1d1d patched) | both (1d1d + 1d2d)
# WGrad (1D1D, FP32 accumulate) and FProp/DGrad (1D2D, BF16 out) at the four Qwen3-8B linears, T = 8192 tokens.
# Operands from a fixed seed (the same bytes in every process); per GEMM: the first call's time (JIT), a SHA-256 of
# the output bytes (patched and unpatched kernels must agree bit for bit), the median of 5 rounds of 20 calls.
import hashlib, json, os, statistics, sys, time
import torch

sys.path.insert(0, os.getcwd())
from megatron_jetrl.fp8 import backends
import importlib.util

variant, out = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
T = 8192
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
dg = backends.deep_gemm_module()
# the patch as measured (not shipped: no gain), archived beside this script
_spec = importlib.util.spec_from_file_location("turns", os.path.join(os.path.dirname(os.path.abspath(__file__)), "deep_gemm_2_5_0_wgrad_turns.py"))
patch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch)
if variant != "orig":
    why = patch.apply(dg, kernels={"wgrad": ("1d1d",), "both": ("1d1d", "1d2d")}[variant])
    assert why is None, why


def timed(fn, reps=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def gen(seed):
    return torch.Generator(device=dev).manual_seed(seed)


def fp8(rows, cols, g):
    return (torch.randn(rows, cols, device=dev, generator=g) * 2).to(E4M3)


def scales(shape, g, outer_major):
    s = torch.rand(*shape[::-1] if outer_major else shape, device=dev, generator=g) + 0.5
    return s.t() if outer_major else s


res = {"variant": variant, "gpu": torch.cuda.get_device_name(), "gemms": {}}
for i, (lin, (n, k)) in enumerate(SHAPES.items()):
    g = gen(100 + i)
    gemms = {}
    # WGrad: dY^T [N, T] . X^T [K, T] -> main_grad [N, K] (+=)
    a, b = fp8(n, T, g), fp8(k, T, g)
    sa, sb = scales((n, T // 128), g, True), scales((k, T // 128), g, True)
    d = torch.zeros(n, k, device=dev)
    gemms[f"{lin} wgrad"] = (2 * n * k * T, lambda a=a, sa=sa, b=b, sb=sb, d=d: dg.fp8_gemm_nt(
        (a, sa), (b, sb), d, c=d, recipe=(1, 1, 128), compiled_dims="mn", disable_ue8m0_cast=True), d)
    # FProp: X [T, K] . W [N, K] -> Y [T, N]; DGrad: dY [T, N] . W^T [K, N] -> dX [T, K]
    for name, (m_, n_, k_) in (("fprop", (T, n, k)), ("dgrad", (T, k, n))):
        x, w = fp8(m_, k_, g), fp8(n_, k_, g)
        sx, sw = scales((m_, k_ // 128), g, True), scales((n_ // 128, k_ // 128), g, False)
        y = torch.empty(m_, n_, device=dev, dtype=torch.bfloat16)
        gemms[f"{lin} {name}"] = (2 * m_ * n_ * k_, lambda x=x, sx=sx, w=w, sw=sw, y=y: dg.fp8_gemm_nt(
            (x, sx), (w, sw), y, disable_ue8m0_cast=True), y)
    for name, (flops, fn, outt) in gemms.items():
        outt.zero_()
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first = time.time() - t0
        h = digest(outt)
        ts = [timed(fn) for _ in range(5)]
        ms = statistics.median(ts)
        res["gemms"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "first_s": first, "sha": h, "spread": [min(ts), max(ts)]}
        print(f"{variant:6s} {name:14s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  first {first:5.2f} s  sha {h}", flush=True)
    del gemms, a, b, d
    torch.cuda.empty_cache()
# odd shapes, for the bits only: a partial last tile of rows (the 1D2D kernel's second warpgroup skips its WGMMAs in
# the last M block at M = 1030) and small N
g = gen(7)
odd = {}
for m_, n_, k_ in ((1030, 384, 640), (8200, 4096, 4096), (4096, 200, 1024)):
    x, w = fp8(m_, k_, g), fp8(n_, k_, g)
    sx, sw = scales((m_, k_ // 128), g, True), scales((-(-n_ // 128), k_ // 128), g, False)
    y = torch.empty(m_, n_, device=dev, dtype=torch.bfloat16)
    dg.fp8_gemm_nt((x, sx), (w, sw), y, disable_ue8m0_cast=True)
    odd[f"fprop {m_}x{n_}x{k_}"] = digest(y)
    sw1 = scales((n_, k_ // 128), g, True)
    d = torch.zeros(m_, n_, device=dev)
    dg.fp8_gemm_nt((x, sx), (w, sw1), d, c=d, recipe=(1, 1, 128), compiled_dims="mn", disable_ue8m0_cast=True)
    odd[f"wgrad {m_}x{n_}x{k_}"] = digest(d)
torch.cuda.synchronize()
res["odd"] = odd
print(variant, "odd shapes:", odd, flush=True)
json.dump(res, open(out, "w"), indent=1)
