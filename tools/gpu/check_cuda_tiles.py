"""Compile every variant of `fp8/cuda_tiles.py`'s CUDA source for sm_90 on a machine without a GPU, and report
each kernel's registers, spills and shared memory (`ptxas -v`).

The GPU machine compiles the same source with NVRTC at first use; this catches a compile error, a register spill
or a shared-memory overflow before a GPU call is spent on it. It needs NVIDIA's NVRTC and ptxas, both pip wheels
of the GPU machine's CUDA 13.0 (no GPU, no driver; requirements.txt installs them, tests/unit/test_cuda_tiles_source.py
runs this):

    pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88
    python tools/gpu/check_cuda_tiles.py            # exit 1 on a compile error

A `--nvrtc` / `--ptxas` path overrides where they are looked up.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.fp8 import cuda_tiles  # noqa: E402

KERNELS = ("quant_tile", "swiglu_bwd_tile")


def _wheel_file(*candidates: tuple[str, ...]) -> Path | None:
    """The first of `candidates` (paths under the `nvidia` namespace package of NVIDIA's pip wheels) that exists."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for parts in candidates:
            if Path(root, *parts).exists():
                return Path(root, *parts)
    return None


NVRTC = (("cu13", "lib", "libnvrtc.so.13"), ("cuda_nvrtc", "lib", "libnvrtc.so.12"))
PTXAS = (("cu13", "bin", "ptxas"), ("cuda_nvcc", "bin", "ptxas"))


def load_nvrtc(path: Path) -> ctypes.CDLL:
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):  # NVRTC dlopens it by name at compile time
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(path))


def nvrtc_ptx(lib: ctypes.CDLL, source: str, arch: str) -> str:
    """NVRTC: `source` -> PTX for `arch`, with the options torch's `_compile_kernel` passes (no fast math)."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cuda_tiles.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [
        f"--gpu-architecture=compute_{arch}".encode(),
        b"-D__CUDA_NO_HALF_OPERATORS__",
        b"-D__CUDA_NO_HALF_CONVERSIONS__",
        b"-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        b"-D__CUDA_NO_HALF2_OPERATORS__",
    ]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if res:
        raise RuntimeError(f"NVRTC error {res}:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def ptxas_report(ptxas: Path, ptx: str, arch: str) -> dict[str, dict]:
    """`ptxas -v` of the PTX: {kernel: {registers, spill_stores, spill_loads, smem}}."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "k.ptx")
        src.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}", "-v", str(src), "-o", str(Path(d, "k.cubin"))], capture_output=True, text=True
        )
    if out.returncode:
        raise RuntimeError(f"ptxas failed:\n{out.stderr}")
    report, name = {}, None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            report[m.group(1)] = {}
        m = re.search(r"Function properties for (\w+)", line)
        if m:  # an entry function's, or a callee's (whose counts are its own)
            name = m.group(1) if m.group(1) in report else None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            report[name].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and name:
            report[name].update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return report


def variant_report(lib: ctypes.CDLL, ptxas: Path, flags: dict, arch: str = "90") -> dict[str, dict]:
    """`ptxas_report` of one variant of the source (`flags`: FP8_IN, ROWS, COLS, UE8M0, optional BLOCK128)."""
    src = cuda_tiles.source(flags["FP8_IN"], flags["ROWS"], flags["COLS"], flags["UE8M0"], flags.get("BLOCK128", 0))
    return ptxas_report(ptxas, nvrtc_ptx(lib, src, arch), arch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvrtc", type=Path, default=_wheel_file(*NVRTC))
    ap.add_argument("--ptxas", type=Path, default=_wheel_file(*PTXAS))
    ap.add_argument("--arch", default="90")
    a = ap.parse_args()
    if a.nvrtc is None or a.ptxas is None:
        print(
            "needs NVRTC and ptxas: pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 (or pass --nvrtc / --ptxas)"
        )
        return 2
    lib = load_nvrtc(a.nvrtc)
    bad = 0
    print(f"{'variant':<44} {'kernel':<16} {'regs':>5} {'spill st/ld':>12} {'smem':>6}")
    for fp8_in, rows, cols, ue8m0, block128 in itertools.product((0, 1), repeat=5):
        if not (rows or cols) or (block128 and (fp8_in or not rows)):
            continue  # 128x128 tiles: BF16 weights, always their rows (and optionally the transposed copy)
        flags = dict(FP8_IN=fp8_in, ROWS=rows, COLS=cols, UE8M0=ue8m0, BLOCK128=block128)
        report = variant_report(lib, a.ptxas, flags, a.arch)
        for kernel in KERNELS:
            if kernel == "swiglu_bwd_tile" and (fp8_in or block128):
                continue  # the SwiGLU kernel reads BF16 and has 1x128 / 128x1 groups: those flags only change quant_tile
            r = report.get(kernel)
            if r is None:
                print(f"{kernel}: missing from the PTX")
                bad += 1
                continue
            variant = " ".join(f"{k}={v}" for k, v in flags.items())
            print(
                f"{variant:<44} {kernel:<16} {r['registers']:>5} {r.get('spill_stores', 0):>5}/{r.get('spill_loads', 0):<6} {r['smem']:>6}"
            )
    print("OK: every variant compiles" if not bad else f"{bad} kernel variant(s) missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
