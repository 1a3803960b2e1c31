"""WGrad at the step's shapes (tokens K = 4096 and 8192): DeepGEMM 1D1D accumulating into FP32 main_grad against
cuBLASLt's blockwise _scaled_mm (1x128 x 1x128, FP32 out) plus an add into main_grad, and BF16 addmm into FP32."""
import torch, triton
from megatron_jetrl.fp8 import kernels as K, backends
from megatron_jetrl.fp8.gemm import blockwise_gemm
dev = "cuda"
for tokens in (4096, 8192):
    for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)):
        dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16); x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        _, _, dyt, dyts = K.quantize_dual(dy, check_finite=False, rows=False)
        _, _, xt, xts = K.quantize_dual(x, check_finite=False, rows=False)
        acc = torch.zeros(n, k, device=dev)
        t_dg = triton.testing.do_bench(lambda: blockwise_gemm(dyt, dyts, xt, xts, b_block=(1, 128), backend="deepgemm", acc=acc), rep=200)
        t_cl = triton.testing.do_bench(lambda: blockwise_gemm(dyt, dyts, xt, xts, b_block=(1, 128), backend="cublaslt", acc=acc), rep=200)
        t_bf = triton.testing.do_bench(lambda: torch.addmm(acc, dy.t(), x, out_dtype=torch.float32, out=acc), rep=200)
        fl = 2 * tokens * n * k / 1e9
        print(f"T={tokens} {name:8s} deepgemm {t_dg*1e3:7.1f} us ({fl/t_dg:5.0f} TF/s)  cublaslt+add {t_cl*1e3:7.1f} us ({fl/t_cl:5.0f})  "
              f"bf16 addmm {t_bf*1e3:7.1f} us ({fl/t_bf:5.0f})  dg/bf16 {t_bf/t_dg:.2f}x  cl/bf16 {t_bf/t_cl:.2f}x", flush=True)
