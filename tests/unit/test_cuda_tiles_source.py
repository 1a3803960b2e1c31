"""The CUDA source of `fp8/cuda_tiles.py` compiles for sm_90 with the GPU machine's CUDA 13.0 NVRTC and ptxas (pip
wheels, no GPU): every kernel of every variant exists, fits its launch bounds, keeps static shared memory under
48 KiB, and spills at most a few bytes; the launchers pass each kernel its arguments by the source's own parameter
names. Their numerics are checked on the GPU (tests/gpu/test_kernels.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))

import check_cuda_tiles as check  # noqa: E402

NVRTC, PTXAS = check._wheel_file(*check.NVRTC), check._wheel_file(*check.PTXAS)
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None or PTXAS is None, reason="needs nvidia-cuda-nvrtc and nvidia-cuda-nvcc (requirements.txt)"
)
MAX_REGISTERS = {"quant_tile": 65536 // (256 * 3), "swiglu_bwd_tile": 65536 // (256 * 2)}  # __launch_bounds__
# the variants the quantizers launch: (FP8_IN, ROWS, COLS, BLOCK128); FP8 input with rows is never launched
LAUNCHED = [(0, 1, 1, 0), (0, 1, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 1)]


@needs_nvrtc
@pytest.mark.parametrize("fp8_in,rows,cols,block128", LAUNCHED)
@pytest.mark.parametrize("ue8m0", [0, 1])
def test_every_tile_kernel_compiles_within_its_launch_bounds(fp8_in, rows, cols, block128, ue8m0):
    lib = check.load_nvrtc(NVRTC)
    flags = dict(FP8_IN=fp8_in, ROWS=rows, COLS=cols, UE8M0=ue8m0, BLOCK128=block128)
    report = check.variant_report(lib, PTXAS, flags)
    for kernel, limit in MAX_REGISTERS.items():
        r = report[kernel]
        assert r["registers"] <= limit, (flags, kernel, r)
        assert r["smem"] < 48 * 1024, (flags, kernel, r)
        assert r.get("spill_stores", 0) + r.get("spill_loads", 0) <= 128, (flags, kernel, r)


@needs_nvrtc
def test_a_compile_error_is_reported_with_nvrtc_s_log():
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC error .*undefined_symbol"):
        check.nvrtc_ptx(check.load_nvrtc(NVRTC), 'extern "C" __global__ void k() { undefined_symbol(); }', "90")


def _signature(kernel: str) -> list[str]:
    """The parameter names of `kernel` in the CUDA source, in order."""
    import re

    src = check.cuda_tiles._SOURCE
    params = src[src.index(f"{kernel}(") + len(kernel) + 1 : src.index(")", src.index(f"{kernel}("))]
    return [re.split(r"[\s*]+", p.strip())[-1] for p in params.split(",")]


@pytest.mark.parametrize("rows,cols", [(True, True), (True, False), (False, True)])
def test_launch_arguments_match_the_kernel_signatures(monkeypatch, rows, cols):
    """What the Python side passes each kernel, by the kernel's own parameter names (no GPU: the launch is caught)."""
    import torch

    tiles = check.cuda_tiles
    launched = {}
    monkeypatch.setattr(tiles, "_make_context_current", lambda device_index: None)
    monkeypatch.setattr(tiles, "_kernel", lambda *a: type("K", (), {"func": a})())
    monkeypatch.setattr(
        tiles, "_launch", lambda func, dev, grid, ptrs, ints: launched.update(func=func, grid=grid, ptrs=ptrs, ints=ints)
    )
    t, i = 272, 384
    gate_up, d_out = torch.empty(t, 2 * i + 8, dtype=torch.bfloat16)[:, : 2 * i], torch.empty(t, i, dtype=torch.bfloat16)
    q, s = (torch.empty(t, 2 * i, dtype=torch.uint8), torch.empty(6, t).t()) if rows else (None, None)
    qt, st = (torch.empty(2 * i, t, dtype=torch.uint8), torch.empty(3, 2 * i).t()) if cols else (None, None)
    tiles.quantize_swiglu_backward(gate_up, d_out, q, s, qt, st, 1e-10, False)
    device = gate_up.get_device()  # the kernel's device is the tensor's own (-1 for these CPU stand-ins)
    assert launched["func"] == (False, rows, cols, False, device, "swiglu_bwd_tile") and launched["grid"] == (3, 3)
    q_, s_ = (q, s) if rows else (qt, st)
    qt_, st_ = (qt, st) if cols else (q, s)
    got = dict(zip(_signature("swiglu_bwd_tile"), launched["ptrs"] + launched["ints"]))
    assert (
        got["gu"] == gate_up.data_ptr()
        and got["dy"] == d_out.data_ptr()
        and got["q"] == q_.data_ptr()
        and got["st"] == st_.data_ptr()
    )
    assert (got["T"], got["I"], got["ldgu"], got["lddy"]) == (t, i, 2 * i + 8, i)
    assert (got["ldq"], got["s_t"], got["s_n"], got["ldqt"], got["st_n"], got["st_t"]) == (
        q_.stride(0),
        s_.stride(0),
        s_.stride(1),
        qt_.stride(0),
        st_.stride(0),
        st_.stride(1),
    )
    x = torch.empty(t, 2 * i, dtype=torch.bfloat16)
    tiles.quantize(x, None, q, s, qt, st, 1e-10, True)
    got = dict(zip(_signature("quant_tile"), launched["ptrs"] + launched["ints"]))
    assert launched["func"][5] == "quant_tile" and launched["grid"] == (18, 1)  # one CTA per tile: 3 x 6 tiles
    assert got["x"] == x.data_ptr() and (got["T"], got["N"], got["ldx"]) == (t, 2 * i, 2 * i)
    assert (got["ldq"], got["s_t"], got["s_n"], got["ldqt"], got["st_n"], got["st_t"]) == (
        q_.stride(0),
        s_.stride(0),
        s_.stride(1),
        qt_.stride(0),
        st_.stride(0),
        st_.stride(1),
    )


def test_launch_arguments_point_at_their_values():
    """cuLaunchKernel reads argument i through params[i]: 6 pointers (64-bit) then 12 ints (32-bit, signed: the
    eps bits may be negative), rewritten in place by every launch."""
    import ctypes

    from megatron_jetrl.fp8.cuda_tiles import _Args

    args = _Args()
    for pointers, ints in (
        ([1, 2**40 + 3, 3, 4, 5, 2**63 + 7], [7, -8, 9, 10, 11, 12, 13, 14, 15, 16, 17, -123456]),
        ([9, 8, 7, 6, 5, 4], list(range(12))),
    ):
        params = args.fill(pointers, ints)
        got = [ctypes.c_uint64.from_address(params[i]).value for i in range(6)]
        got += [ctypes.c_int32.from_address(params[6 + i]).value for i in range(12)]
        assert got == pointers + ints
