# Session 25 plan: ncu on the H200 for the two quantizers that stay at 65-67% of the copy rate there (issue 14):
#   ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
#       --section Occupancy --section MemoryWorkloadAnalysis -k regex:"quant" --launch-skip 2 --launch-count 2 \
#       python3 .calls/s25_ncu_quant.py > $OUT/ncu.txt
# (bash tools/gpu_fp8.sh setup first; PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD). Question: issue-bound (issue slots busy
# ~85%+, stall "not selected"/"math pipe throttle") or latency-bound (long-scoreboard stalls, low eligible warps)?
# tools/check_triton_kernels.py --sass says 56.6 static main-path instructions/element (SwiGLU) vs 26.9 (plain).
import torch
from megatron_jetrl.fp8 import kernels

T, I = 16384, 8192
gu = torch.randn(T, 2 * I, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    kernels.quantize_1x128(gu, swiglu=True, check_finite=False)          # Triton _quant_1x128 SWIGLU
x = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
q, s = kernels.quantize_1x128(x, check_finite=False)
for _ in range(3):
    kernels.quantize_dual(q, check_finite=False, rows=False, x_scale=s)  # 128x1^T from E4M3 (CUDA tile kernel)
torch.cuda.synchronize()
