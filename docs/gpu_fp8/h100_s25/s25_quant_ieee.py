# Session 25 call A: bench_fp8's quant section with the Triton quantizers dividing the IEEE way per element (DIV 0),
# the code before this session, to set beside the shipped run (Markstein, `division_steps`) in the same call.
import sys
sys.path.insert(0, "tools")
from megatron_jetrl.fp8 import kernels
kernels.division_steps = lambda dtype, eps: 0
import bench_fp8
sys.exit(bench_fp8.main(sys.argv[1:]))
