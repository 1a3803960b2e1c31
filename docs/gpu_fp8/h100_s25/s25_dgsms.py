# Session 25: DeepGEMM 1D2D (vLLM's decode GEMM) at decode batch sizes, with its SM budget (deep_gemm.set_num_sms)
# swept: its heuristic minimizes waves over num_sms, so at M=128 and N=4096 it picks 64-row tiles (each weight tile
# fetched by two CTAs). Fewer SMs -> 128-row tiles, each weight byte read once, fewer streams. Times as CUDA-graph
# replays (do_bench_cudagraph); GB/s counts weights + activations; BF16 torch.mm beside it.
import os, sys, json
os.environ.setdefault("DG_PRINT_CONFIGS", "1")
import torch, triton
from megatron_jetrl.fp8 import kernels
from megatron_jetrl.fp8.backends import deep_gemm_module
dg = deep_gemm_module()
dev = "cuda"
x = torch.empty(1 << 28, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
t = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200)
copy = 2 * x.numel() / t / 1e6  # GB/s read + write
del x, y
print(f"copy {copy:.0f} GB/s", flush=True)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
full = dg.get_num_sms()
SMS = [full, 96, 66, 64]
res = {"copy_GBps": copy, "rows": []}
for m in (128, 256):
    for name, (n, k) in SHAPES.items():
        a_q, a_s = kernels.quantize_1x128(torch.randn(m, k, device=dev, dtype=torch.bfloat16), check_finite=False)
        reps = max(4, -(-(160 << 20) // (n * k)))  # weight copies in rotation: > 3x the 50 MB L2 in FP8, as in decode
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        ws = [w] + [w.roll(i, 0) for i in range(1, reps)]
        bqs = [kernels.quantize_128x128(wi, check_finite=False) for wi in ws]
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        tb = triton.testing.do_bench_cudagraph(lambda: [torch.mm(xb, wi.t()) for wi in ws], rep=100) / reps
        bytes_fp8 = n * k + m * k
        del ws
        row = {"M": m, "reps": reps, "linear": name, "N": n, "K": k, "bf16_us": tb * 1e3, "bf16_pct": 100 * 2 * n * k / tb / 1e6 / copy}
        ref = None
        for sms in SMS:
            dg.set_num_sms(sms)
            b_q, b_s = bqs[0]
            dg.fp8_gemm_nt((a_q, a_s), (b_q, b_s), d, disable_ue8m0_cast=True)
            torch.cuda.synchronize()
            if ref is None:
                ref = d.clone()
            same = bool(torch.equal(d, ref))
            tf = triton.testing.do_bench_cudagraph(
                lambda: [dg.fp8_gemm_nt((a_q, a_s), bq, d, disable_ue8m0_cast=True) for bq in bqs], rep=100) / reps
            row[f"sms{sms}_us"] = tf * 1e3
            row[f"sms{sms}_pct"] = 100 * bytes_fp8 / tf / 1e6 / copy
            row[f"sms{sms}_same_bits"] = same
        dg.set_num_sms(full)
        best = min(SMS, key=lambda s: row[f"sms{s}_us"])
        print(f"M={m:4d} {name:8s} bf16 {row['bf16_us']:7.1f} us ({row['bf16_pct']:4.1f}%)  DG@{full} {row[f'sms{full}_us']:7.1f} us "
              f"({row[f'sms{full}_pct']:4.1f}%)  best @{best} {row[f'sms{best}_us']:7.1f} us ({row[f'sms{best}_pct']:4.1f}%)  "
              + " ".join(f"{s}:{row[f'sms{s}_us']:.1f}{'' if row[f'sms{s}_same_bits'] else '*'}" for s in SMS), flush=True)
        res["rows"].append(row)
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "dgsms.json", "w"), indent=1)
