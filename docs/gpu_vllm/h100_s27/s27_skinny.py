# Session 27 prototype (not shipped): a skinny-M block-scaled FP8 GEMM for decode (issue 13's lever), against
# DeepGEMM 1D2D (what vLLM runs) at the four Qwen3-8B linears, M = 128 and 256.
# C[M, N] (bf16) = sum over 128-wide K blocks kb of (sa[m, kb] * sw[n // 128, kb]) * (A_q[m, kb] . W_q[n, kb]),
# each K block's product a fresh FP32 WGMMA accumulation, promoted by one FMA as DeepGEMM's sm90 1D2D kernel does
# (sm90_fp8_gemm_1d2d.cuh: `final += (scale_a * scale_b) * accum`), so the bits can equal DeepGEMM's.
# One program per BLOCK_N columns and all M rows (BLOCK_M = M): every weight byte is read once, by one program.
import sys

import triton
import triton.language as tl


@triton.jit
def skinny_fp8_gemm(a_ptr, sa_ptr, w_ptr, sw_ptr, c_ptr, M, N, K, stride_sam, stride_sak,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    m_ok = rm < M
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    kb_n = K // 128
    sw_row = sw_ptr + (pid_n * BLOCK_N // 128) * kb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, kb_n, num_stages=STAGES):
        a = tl.load(a_ptrs + kb * 128, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + kb * 128)
        blk = tl.dot(a, tl.trans(w))
        sa = tl.load(sa_ptr + rm * stride_sam + kb * stride_sak, mask=m_ok, other=0.0)
        sw = tl.load(sw_row + kb)
        acc = tl.fma(sa[:, None] * sw, blk, acc)
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None])


def launch(a_q, sa, w_q, sw, c, block_n, stages, warps, block_m=None):
    M, K = a_q.shape
    N = w_q.shape[0]
    block_m = block_m or M
    grid = (N // block_n, triton.cdiv(M, block_m))
    skinny_fp8_gemm[grid](a_q, sa, w_q, sw, c, M, N, K, sa.stride(0), sa.stride(1),
                          BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=warps)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--compile-only":
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "stride_sam": "i32", "stride_sak": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr"}
    names = skinny_fp8_gemm.arg_names
    for bm, bn, st, w in ((128, 32, 4, 4), (256, 16, 4, 8), (128, 64, 3, 4)):
        src = ASTSource(fn=skinny_fp8_gemm, signature=sig,
                        constexprs={(names.index("BLOCK_M"),): bm, (names.index("BLOCK_N"),): bn, (names.index("STAGES"),): st},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "w_ptr", "c_ptr", "N", "K")})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
        sass_wgmma = k.asm["ptx"].count("wgmma.mma_async")
        print(f"BM {bm} BN {bn} stages {st} warps {w}: ok, {sass_wgmma} wgmma in PTX, shared {k.metadata.shared} B, "
              f"cp.async {k.asm['ptx'].count('cp.async')}")
    sys.exit(0)

if __name__ == "__main__":
    import json
    import torch
    from megatron_jetrl.fp8 import kernels
    from megatron_jetrl.fp8.backends import deep_gemm_module
    dg = deep_gemm_module()
    dev = "cuda"
    x = torch.empty(1 << 28, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200)
    copy = 2 * x.numel() / t / 1e6
    del x, y
    print(f"copy {copy:.0f} GB/s {torch.cuda.get_device_name()}", flush=True)
    SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    CONFIGS = [(bm, bn, st, 4) for bm in (None, 64) for bn in (32, 64, 128) for st in (3, 5)]
    out = {"copy_GBps": copy, "rows": []}
    torch.manual_seed(0)
    for m in (128, 256):
        for name, (n, k) in SHAPES.items():
            a_q, a_s = kernels.quantize_1x128(torch.randn(m, k, device=dev, dtype=torch.bfloat16), check_finite=False)
            reps = max(4, -(-(160 << 20) // (n * k)))
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            bqs = [kernels.quantize_128x128(w.roll(i, 0) if i else w, check_finite=False) for i in range(reps)]
            d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            dg.fp8_gemm_nt((a_q, a_s), bqs[0], d, disable_ue8m0_cast=True)
            ref = d.clone()
            t_dg = triton.testing.do_bench_cudagraph(
                lambda: [dg.fp8_gemm_nt((a_q, a_s), bq, d, disable_ue8m0_cast=True) for bq in bqs], rep=100) / reps
            nbytes = n * k + m * k
            row = {"M": m, "linear": name, "N": n, "K": k, "deepgemm_us": t_dg * 1e3, "deepgemm_pct": 100 * nbytes / t_dg / 1e6 / copy,
                   "configs": []}
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            for bm, bn, st, wp in CONFIGS:
                try:
                    wp = 8 if (bm or m) * bn >= 256 * 64 else wp
                    launch(a_q, a_s, bqs[0][0], bqs[0][1], c, bn, st, wp, bm)
                    torch.cuda.synchronize()
                    same = bool(torch.equal(c, ref))
                    diff = (c.float() - ref.float()).abs().max().item()
                    tt = triton.testing.do_bench_cudagraph(
                        lambda: [launch(a_q, a_s, bq, bs, c, bn, st, wp, bm) for bq, bs in bqs], rep=100) / reps
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
                    row["configs"].append({"cfg": [bm, bn, st, wp], "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                row["configs"].append({"cfg": [bm or m, bn, st, wp], "us": tt * 1e3, "pct": 100 * nbytes / tt / 1e6 / copy,
                                       "same_bits": same, "max_diff": diff})
            ok = [r for r in row["configs"] if "us" in r]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            out["rows"].append(row)
            if best:
                print(f"M={m:4d} {name:8s} DeepGEMM {row['deepgemm_us']:6.1f} us ({row['deepgemm_pct']:4.1f}%)  skinny best "
                      f"{best['us']:6.1f} us ({best['pct']:4.1f}%) cfg BMxBN {best['cfg'][0]}x{best['cfg'][1]} st{best['cfg'][2]} w{best['cfg'][3]} "
                      f"bits equal {best['same_bits']} (all configs equal: {all(r['same_bits'] for r in ok)}; max diff {max(r['max_diff'] for r in ok):.3g})",
                      flush=True)
            else:
                print(f"M={m} {name}: no config ran: {row['configs'][:2]}", flush=True)
    json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "skinny.json", "w"), indent=1)
