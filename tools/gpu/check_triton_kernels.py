"""Compile the project's Triton kernels that the vLLM fused activation quantization adds or changes, for sm_90, on a
machine without a GPU, and check that fusing the quantizer into the RMSNorm kernel leaves the norm's own code alone.

* `actor.glue_kernels`' RMSNorm forward, with and without a residual, with and without the fused 1x128 quantization
  (`QUANT`), at the program shapes vLLM's hidden sizes give (one to thirty-two rows per program);
* `fp8.kernels`' 1x128 quantizer with the SwiGLU prologue, with and without the BF16 product store (`PRODUCT`).

For the norm, the TTGIR (Triton's GPU IR after its layout passes) of the `QUANT` kernel must equal the plain kernel's
up to the store of y, layouts included: the same ops in the same layouts are what give y the same bits (a first
version, which reshaped y in registers to quantize it, differed from the plain kernel in 2e-5 of y's bits at width 1024
on an H200). It needs Triton 3.6.0, the GPU machine's (its wheel carries ptxas; no GPU, no driver):

    pip download --no-deps triton==3.6.0 -d .cache/wheels   # tools/test.sh does this
    python tools/gpu/check_triton_kernels.py                      # with triton importable; exit 1 on a failure

tests/unit/test_triton_kernels_source.py runs it with the wheel unpacked beside the CPU environment (torch stays CPU).

    python tools/gpu/check_triton_kernels.py --sass               # instructions per element of the 1x128 quantizer

`--sass` prints, for the Triton 1x128 quantizer with and without the SwiGLU prologue at its shipped launch settings,
each with the per-element IEEE division (DIV=0) and with the per-group reciprocal BF16 input takes (DIV=1,
`kernels.division_steps`), the static SASS instructions per element on the kernel's main path (up to its first
unconditional EXIT: the IEEE division's slow path lies behind it), compiled as a launch on aligned tensors compiles
it, with the commonest ops.
A kernel that issues that many instructions per element cannot beat the GPU's issue rate, whatever its memory does.
"""

from __future__ import annotations

import collections
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TRITON = "3.6.0"
NORM_SHAPES = ((4096, 1, 8), (2048, 2, 8), (1024, 4, 4), (512, 8, 4), (256, 16, 4))
"""(BLOCK_N, BLOCK_R, num_warps) of `glue_kernels._blocks` for hidden sizes 4096, 1536-2048, 640-1024, 512, 128."""


def _compile(fn, signature: dict, constexprs: dict, warps: int, aligned: tuple = ()):
    """Compile for sm_90; `aligned`: the arguments a launch would specialize as divisible by 16 (pointers, sizes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _signature(fn, pointers: dict, floats: tuple, constexprs: tuple) -> dict:
    return {
        n: pointers.get(n, "*bf16")
        if n.endswith("_ptr")
        else "fp32"
        if n in floats
        else "constexpr"
        if n in constexprs
        else "i32"
        for n in fn.arg_names
    }


_LOC = re.compile(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")
"""A source location, `loc(...)` with up to two levels of parentheses inside (numbered differently per kernel)."""


def norm_part(ttgir: str) -> list[str]:
    """The ops of a kernel's TTGIR up to its first store: SSA names and source locations dropped, each layout alias
    (`#blocked2`, numbered per kernel) replaced by its definition."""
    layouts = dict(re.findall(r"^(#(?:blocked|linear|shared|mma)\w*) = (.*)$", ttgir, re.M))
    alias = re.compile("|".join(sorted(map(re.escape, layouts), key=len, reverse=True)) + r"(?!\w)") if layouts else None
    ops = []
    for line in ttgir.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "arith.constant" in line:  # constants: the QUANT path adds its own
            continue
        line = _LOC.sub("", re.sub(r"%[\w#]+", "%v", line))
        ops.append(alias.sub(lambda m: layouts[m.group(0)], line) if alias else line)
        if "tt.store" in line:
            break
    return ops


def check() -> list[str]:
    """Compile every variant; the problems found (empty: all compiled and the fused norm's own part is unchanged)."""
    from megatron_jetrl.actor import glue_kernels
    from megatron_jetrl.fp8 import kernels

    problems = []
    rms = glue_kernels._k()["rms_fwd"].fn
    sig = _signature(
        rms,
        {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "r_ptr": "*fp32"},
        ("inv_n", "eps", "q_eps"),
        ("BLOCK_R", "BLOCK_N", "HAS_RES", "QUANT"),
    )
    for block_n, block_r, warps in NORM_SHAPES:
        for res in (False, True):
            plain_ops, fused_ops = (
                norm_part(_compile(rms, sig, dict(BLOCK_R=block_r, BLOCK_N=block_n, HAS_RES=res, QUANT=q), warps).asm["ttgir"])
                for q in (False, True)
            )
            where = f"rms_fwd BLOCK_N={block_n} BLOCK_R={block_r} residual={res}"
            if plain_ops != fused_ops:
                problems.append(f"{where}: with QUANT the norm's ops or layouts up to y's store differ from the plain kernel's")
            else:
                print(f"ok  {where}: {len(plain_ops)} ops up to y's store, identical with QUANT", flush=True)
    quant = kernels._k()["quant_1x128"].fn
    sig = _signature(
        quant, {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, ("eps",), ("BLOCK_M", "G", "UE8M0", "SWIGLU", "EVEN", "PRODUCT", "DIV")
    )
    for product, div in ((False, 1), (True, 1), (True, 0), (True, 2)):
        for even in (False, True):
            _compile(quant, sig, dict(BLOCK_M=16, G=1, UE8M0=False, SWIGLU=True, EVEN=even, PRODUCT=product, DIV=div), 4)
            print(f"ok  quant_1x128 SWIGLU PRODUCT={product} EVEN={even} DIV={div}: compiled", flush=True)
    return problems


def sass_per_element(swiglu: bool, div: int) -> tuple[float, collections.Counter]:
    """(static main-path SASS instructions per element, op counts per element) of the 1x128 quantizer at the shipped
    launch settings (`fp8.kernels.QUANT_CFG["1x128"]`), sm_90, aligned operands as a launch specializes them; `div`:
    its division (`kernels.division_steps`: 0 IEEE, 1 what BF16 input takes)."""
    import triton

    from megatron_jetrl.fp8 import kernels

    cfg = kernels.QUANT_CFG["1x128"]
    quant = kernels._k()["quant_1x128"].fn
    const = dict(
        BLOCK_M=cfg["block_m"], G=cfg["groups"], UE8M0=False, SWIGLU=swiglu, EVEN=True, PRODUCT=False, DIV=div, stride_sm=1
    )
    sig = _signature(quant, {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, ("eps",), tuple(const))
    aligned = tuple(
        n for n in quant.arg_names if n.endswith("_ptr") or n in ("M", "K", "stride_xm", "stride_qm", "stride_sk", "stride_pm")
    )
    cubin = _compile(quant, sig, const, cfg["num_warps"], aligned).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        listing = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in listing.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if not m:
            continue
        ops[m.group(2)] += 1
        if m.group(2) == "EXIT" and not m.group(1):
            break
    per_thread = cfg["block_m"] * cfg["groups"] * 128 / (32 * cfg["num_warps"])
    return sum(ops.values()) / per_thread, collections.Counter({k: v / per_thread for k, v in ops.items()})


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        return 0
    try:
        import triton
    except ImportError:
        print(f"needs triton=={TRITON} (pip install triton=={TRITON}; no GPU needed)", file=sys.stderr)
        return 2
    if triton.__version__ != TRITON:
        print(f"warning: triton {triton.__version__}, the GPU machine has {TRITON}: layouts may differ", file=sys.stderr)
    if "--sass" in sys.argv[1:]:
        for swiglu, div in itertools.product((False, True), (0, 1)):
            total, ops = sass_per_element(swiglu, div)
            common = ", ".join(f"{op} {n:.1f}" for op, n in ops.most_common(8))
            print(f"sass quant_1x128{' SWIGLU' if swiglu else ''} DIV={div}: {total:.1f} instructions per element ({common})")
        return 0
    problems = check()
    for p in problems:
        print("FAIL", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
