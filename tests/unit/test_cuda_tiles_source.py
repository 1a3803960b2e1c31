"""The CUDA source of `fp8/cuda_tiles.py` compiles for sm_90 with the GPU machine's CUDA 13.0 NVRTC and ptxas (pip
wheels, no GPU): every kernel of every variant exists, fits its launch bounds, keeps static shared memory under
48 KiB, and spills at most a few bytes. Its numerics are checked on the GPU (tests/gpu/test_kernels.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import check_cuda_tiles as check  # noqa: E402

NVRTC, PTXAS = check._wheel_file(*check.NVRTC), check._wheel_file(*check.PTXAS)
pytestmark = pytest.mark.skipif(NVRTC is None or PTXAS is None, reason="needs nvidia-cuda-nvrtc and nvidia-cuda-nvcc (requirements.txt)")
MAX_REGISTERS = {"quant_tile": 65536 // (256 * 3), "swiglu_bwd_tile": 65536 // (256 * 2)}  # __launch_bounds__


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 0), (0, 1)])
@pytest.mark.parametrize("ue8m0", [0, 1])
def test_every_tile_kernel_compiles_within_its_launch_bounds(rows, cols, ue8m0):
    lib = check.load_nvrtc(NVRTC)
    for fp8_in in (0, 1):
        flags = dict(FP8_IN=fp8_in, ROWS=rows, COLS=cols, UE8M0=ue8m0)
        source = "".join(f"#define {k} {v}\n" for k, v in flags.items()) + check.cuda_tiles._SOURCE
        report = check.ptxas_report(PTXAS, check.nvrtc_ptx(lib, source, "90"), "90")
        for kernel, limit in MAX_REGISTERS.items():
            r = report[kernel]
            assert r["registers"] <= limit, (flags, kernel, r)
            assert r["smem"] < 48 * 1024, (flags, kernel, r)
            assert r.get("spill_stores", 0) + r.get("spill_loads", 0) <= 128, (flags, kernel, r)


def test_a_compile_error_is_reported_with_nvrtc_s_log():
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC error .*undefined_symbol"):
        check.nvrtc_ptx(check.load_nvrtc(NVRTC), 'extern "C" __global__ void k() { undefined_symbol(); }', "90")
