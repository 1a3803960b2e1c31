# session 29 probe (issue 14): DeepGEMM 2.5.0's 1D1D WGrad kernel with experimental header edits that change only
# register allocation and the pipeline's unrolling (no arithmetic), one variant per process:
#   python3 .calls/s29_wgvar.py VARIANT OUT.json     VARIANT: orig | regs | nounroll | lazyb
#   regs      the producer warpgroup 40 registers, the math warpgroups 232 (what the kernel gives K-grouped GEMMs):
#             ptxas reports 104 bytes of spill stores at the WGrad tiles (128 x 152) with 24 / 240, 4 with 40 / 232
#   nounroll  no unrolling of the stage loop (40 / 232 follow): no spill
#   lazyb     B's scales read from shared memory during the promotion instead of 19 float2 registers held across
#             the WGMMAs; the stage released after the promotion
# Operands from a fixed seed; a SHA-256 of each output (every variant must give the unpatched bits) and the median of
# 5 rounds of 20 calls, T = 8192 tokens at the four Qwen3-8B linears.
import hashlib, json, os, shutil, statistics, sys, time
import torch

sys.path.insert(0, os.getcwd())
from megatron_jetrl.fp8 import backends

variant, out = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
dg = backends.deep_gemm_module()
H = "deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh"
EDITS = {
    "regs": [("    constexpr uint32_t kNumTMARegisters = (kNumPipelineUnrolls == 0 ? 40 : 24);\n    constexpr uint32_t kNumMathRegisters = (kNumPipelineUnrolls == 0 ? 232 : 240);\n",
              "    constexpr uint32_t kNumTMARegisters = 40;\n    constexpr uint32_t kNumMathRegisters = 232;\n")],
    "nounroll": [("constexpr uint32_t kNumPipelineUnrolls = (kGemmType == GemmType::KGroupedContiguous ? 0 : kNumStages);",
                  "constexpr uint32_t kNumPipelineUnrolls = 0;")],
    "lazyb": [
        ("                // Read B scales\n                #pragma unroll\n                for (int i = 0; i < WGMMA::kNumAccum / 4; ++i)\n                    scales_b[i] = ptx::ld_shared(reinterpret_cast<float2*>(smem_sfb[stage_idx] + i * 8 + col_idx * 2));\n", ""),
        ("                // Notify barrier arrival\n                empty_barrier_arrive(stage_idx);\n\n", ""),
        ("                    const float &scale_b_0 = scales_b[i].x;\n                    const float &scale_b_1 = scales_b[i].y;\n",
         "                    const float2 scale_b = ptx::ld_shared(reinterpret_cast<float2*>(smem_sfb[stage_idx] + i * 8 + col_idx * 2));\n"
         "                    const float &scale_b_0 = scale_b.x;\n                    const float &scale_b_1 = scale_b.y;\n"),
        ("                    final_accum[i * 4 + 3] += scale_a_1 * scale_b_1 * accum[i * 4 + 3];\n                }\n",
         "                    final_accum[i * 4 + 3] += scale_a_1 * scale_b_1 * accum[i * 4 + 3];\n                }\n                empty_barrier_arrive(stage_idx);\n"),
        ("            float2 scales_b[WGMMA::kNumAccum / 4];\n", ""),
    ],
}
if variant != "orig":
    lib = os.path.dirname(os.path.abspath(dg.__file__))
    root = f"/tmp/dgvar-{variant}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(f"{lib}/include", f"{root}/include")
    text = open(f"{root}/include/{H}").read()
    for a, b in EDITS[variant]:
        assert text.count(a) == 1, (variant, a[:80])
        text = text.replace(a, b)
    open(f"{root}/include/{H}", "w").write(text)
    dg._C.init(root, dg._find_cuda_home())

E4M3, T = torch.float8_e4m3fn, 8192
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def timed(fn, reps=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


res = {"variant": variant, "gemms": {}}
for i, (lin, (n, k)) in enumerate(SHAPES.items()):
    g = torch.Generator(device=dev).manual_seed(100 + i)
    a = (torch.randn(n, T, device=dev, generator=g) * 2).to(E4M3)
    b = (torch.randn(k, T, device=dev, generator=g) * 2).to(E4M3)
    sa = (torch.rand(T // 128, n, device=dev, generator=g) + 0.5).t()
    sb = (torch.rand(T // 128, k, device=dev, generator=g) + 0.5).t()
    d = torch.zeros(n, k, device=dev)
    fn = lambda: dg.fp8_gemm_nt((a, sa), (b, sb), d, c=d, recipe=(1, 1, 128), compiled_dims="mn", disable_ue8m0_cast=True)
    t0 = time.time(); fn(); torch.cuda.synchronize(); first = time.time() - t0
    sha = hashlib.sha256(d.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
    ts = [timed(fn) for _ in range(5)]
    ms = statistics.median(ts)
    res["gemms"][lin] = {"ms": ms, "tflops": 2 * n * k * T / ms / 1e9, "first_s": first, "sha": sha}
    print(f"{variant:8s} {lin:8s} {ms:7.3f} ms {2 * n * k * T / ms / 1e9:6.0f} TFLOP/s first {first:5.2f} s sha {sha}", flush=True)
json.dump(res, open(out, "w"), indent=1)
