"""The Triton kernels of vLLM's fused activation quantization compile for sm_90 with the GPU machine's Triton 3.6.0
(its wheel, no GPU: tools/gpu/check_triton_kernels.py), and the RMSNorm kernel with the quantizer fused compiles the norm
itself to the plain kernel's ops and layouts, so y keeps its bits (a first version did not, at widths below 4096: the
GPU found it, and this check flags that version too). Their numerics are checked on the GPU (tests/gpu/test_fused.py,
tests/gpu/test_kernels.py, tests/gpu/test_vllm.py)."""

import glob
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("JETRL_WHEEL_CACHE", ROOT / ".cache" / "wheels"))


def _triton_site() -> Path:
    """The Triton 3.6.0 wheel of the wheel cache, unpacked once next to it (torch stays the CPU build)."""
    wheels = sorted(glob.glob(str(CACHE / f"triton-3.6.0-cp3{sys.version_info.minor}-*.whl")))
    if not wheels:
        pytest.skip("triton 3.6.0 wheel missing from the wheel cache: run tools/test.sh, which fetches it")
    site = CACHE / f"triton-3.6.0-cp3{sys.version_info.minor}-site"
    if not (site / "triton" / "__init__.py").exists():
        zipfile.ZipFile(wheels[-1]).extractall(site)
        for ptxas in (site / "triton" / "backends" / "nvidia" / "bin").glob("*"):
            ptxas.chmod(0o755)  # zip keeps no modes
    return site


def test_fused_quantization_kernels_compile_and_leave_the_norm_as_it_was():
    site = _triton_site()
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu" / "check_triton_kernels.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("ok  rms_fwd") == 10 and done.stdout.count("ok  quant_1x128") == 8


def test_sass_counts_the_quantizers_instructions_per_element():
    """`check_triton_kernels.py --sass`: the 1x128 quantizer's main path at its shipped launch settings, compiled as an
    aligned launch compiles it (vectorized loads: under 40 instructions an element; an unaligned compile reads one
    element per load and counts about three times as many), and the SwiGLU prologue (exp, an IEEE division, BF16
    roundings) adds to it. Dividing by the group's scale through one reciprocal and a Markstein correction (DIV=1, what
    BF16 takes) issues fewer instructions than the IEEE division per element (DIV=0): 15.1 against 24.9 plain, 42.0
    against 52.8 with SwiGLU (Triton 3.6.0)."""
    site = _triton_site()
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu" / "check_triton_kernels.py"), "--sass"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = {
        (name, int(div)): float(n)
        for name, div, n in re.findall(
            r"sass (quant_1x128(?: SWIGLU)?) DIV=(\d): ([0-9.]+) instructions per element", done.stdout
        )
    }
    plain, swiglu = counts[("quant_1x128", 1)], counts[("quant_1x128 SWIGLU", 1)]
    assert 10 < plain < 20 and plain < counts[("quant_1x128", 0)] - 5, done.stdout
    assert plain < swiglu < 45 and swiglu < counts[("quant_1x128 SWIGLU", 0)] - 5, done.stdout
