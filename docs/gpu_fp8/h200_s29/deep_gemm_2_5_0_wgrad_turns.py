"""DeepGEMM **2.5.0**'s sm90 1D1D kernel (the recipe's WGrad) with its two math warpgroups taking turns (runtime patch).

ARCHIVED, NOT SHIPPED (session 29, call D on an H200): bit-identical to the unpatched kernels on every shape tried, and
no faster (WGrad 0.94-0.99x, FProp / DGrad 0.88-1.04x). The premise below (idle tensor cores during a lockstep
promotion) did not hold; see BENCHMARKS.md. It was loaded from `patches/` for that call.

Why (the hypothesis tested): in `include/deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh` both math warpgroups wait on the same stage barrier, issue
their four WGMMAs of a 128-token block together, wait for them, and then both promote (`final += sa[m] * sb[n] *
block`, two CUDA-core operations per accumulator) while the tensor cores have nothing queued. At the WGrad tiles
(128 x 152) the promotion is about half as long as the block's WGMMAs, so the tensor cores idle about a third of
the time: the kernel ran at 796-941 TFLOP/s on an H200 against 1226-1410 for the 1D2D kernel of FProp / DGrad
(BENCHMARKS.md, session 29), and no other kernel here does better (Triton 0.22-0.59x of it, cuBLASLt 0.92x).

What: the warpgroups issue their WGMMAs in strict turns (warpgroup 0, 1, 0, 1, ... over every block of every tile),
through two named barriers (14 and 15; DeepGEMM uses 0 and its per-warpgroup ones): one `bar.sync` before a
warpgroup's `warpgroup_arrive` waits for the other's previous issue, one `bar.arrive` after its commit passes the
turn. The second warpgroup's WGMMAs then queue behind the first's, and each warpgroup promotes while the other's
run. Nothing else changes: same tiles, same pipeline, same WGMMAs, same promotion expression in the same order,
so the output is bit-identical to the unpatched kernel (tests/gpu). Kernels with one math warpgroup are unchanged.

How: `apply(module)` writes a patched copy of the module's `include/` tree (once, under `cache_root()`, keyed by the
header's hash) and points DeepGEMM's JIT at it (`_C.init(root, cuda_home)`); the JIT keys its kernel cache by the
sources it includes, so patched and unpatched kernels never mix. It refuses (returns the reason, changes nothing)
when the header is not the one this patch was written against.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

TARGET_VERSION = "2.5.0"
HEADERS = {"1d1d": "deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh", "1d2d": "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"}
SHIPPED = ("1d1d",)
"""The kernels `apply` patches by default: WGrad's. The same turns in the 1D2D kernel (FProp / DGrad) are
`apply(module, kernels=("1d1d", "1d2d"))`."""

_HELPERS = r"""
// megatron-jetrl patch (patches/deep_gemm_2_5_0_wgrad_turns.py): the two math warpgroups issue their WGMMAs in turn
__device__ __forceinline__ void jetrl_turn_wait(const uint32_t& wg, const uint32_t& turn) {
    if (wg == 0) {
        if (turn > 0) asm volatile("bar.sync 15, 256;" ::: "memory");
    } else {
        asm volatile("bar.sync 14, 256;" ::: "memory");
    }
}
__device__ __forceinline__ void jetrl_turn_pass(const uint32_t& wg) {
    if (wg == 0) asm volatile("bar.arrive 14, 256;" ::: "memory");
    else asm volatile("bar.arrive 15, 256;" ::: "memory");
}
"""
_TWO = "if constexpr (kNumMathThreads == 256) "

# (anchor, replacement): each anchor occurs exactly once in the 2.5.0 header it applies to
_COMMON = (
    ("namespace deep_gemm {\n", "namespace deep_gemm {\n" + _HELPERS),
    ("        const auto math_wg_idx = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);\n",
     "        const auto math_wg_idx = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);\n"
     "        uint32_t jetrl_turn = 0;\n"),
    ("ptx::warpgroup_arrive();\n", _TWO + "jetrl_turn_wait(math_wg_idx, jetrl_turn); ptx::warpgroup_arrive();\n"),
    ("ptx::warpgroup_commit_batch();\n", "ptx::warpgroup_commit_batch(); " + _TWO + "jetrl_turn_pass(math_wg_idx), ++ jetrl_turn;\n"),
    ("            __syncwarp();\n        }\n    }\n#else\n",
     "            __syncwarp();\n        }\n"
     "        // the first warpgroup takes the second's last pass, so no barrier is left half-arrived\n"
     "        " + _TWO + "{\n"
     "            if (math_wg_idx == 0 and jetrl_turn > 0) asm volatile(\"bar.sync 15, 256;\" ::: \"memory\");\n"
     "        }\n"
     "    }\n#else\n"),
)
EDITS = {
    "1d1d": _COMMON,
    # a warpgroup whose rows are all past M skips its WGMMAs: it still takes its turns, one per wave of a block
    "1d2d": _COMMON + (
        ("                    full_barriers[stage_idx]->wait(phase);\n                    empty_barrier_arrive();\n",
         "                    full_barriers[stage_idx]->wait(phase);\n"
         "                    " + _TWO + "{\n"
         "                        for (uint32_t w = 0; w < BLOCK_M / WAVE_BLOCK_M; ++ w)\n"
         "                            jetrl_turn_wait(math_wg_idx, jetrl_turn), jetrl_turn_pass(math_wg_idx), ++ jetrl_turn;\n"
         "                    }\n"
         "                    empty_barrier_arrive();\n"),
    ),
}


def patched_source(text: str, kernel: str = "1d1d") -> str:
    """The 2.5.0 header of `kernel` with the turns; ValueError naming the first anchor that is missing or not unique."""
    for anchor, replacement in EDITS[kernel]:
        if text.count(anchor) != 1:
            raise ValueError(f"{HEADERS[kernel]}: expected one {anchor.strip().splitlines()[0]!r}, found {text.count(anchor)}")
        text = text.replace(anchor, replacement)
    return text


def cache_root() -> Path:
    return Path(os.environ.get("JETRL_CACHE", Path.home() / ".cache" / "megatron_jetrl")) / "deep_gemm"


def apply(module, kernels: tuple[str, ...] = SHIPPED) -> str | None:
    """Point `module` (an imported DeepGEMM 2.5.0) at an include tree with `kernels` patched. None when applied, else
    why not (nothing changed)."""
    version = getattr(module, "__version__", None)
    if version != TARGET_VERSION:
        return f"DeepGEMM {version} is not {TARGET_VERSION}, which this patch was written against"
    lib_root = Path(module.__file__).resolve().parent
    originals = {k: (lib_root / "include" / HEADERS[k]).read_text() for k in kernels}
    try:
        texts = {k: patched_source(t, k) for k, t in originals.items()}
    except ValueError as e:
        return str(e)
    key = hashlib.sha256("".join(originals[k] for k in sorted(originals)).encode()).hexdigest()[:16]
    root = cache_root() / f"{TARGET_VERSION}-{'-'.join(sorted(kernels))}-{key}-turns"
    if not all((root / "include" / HEADERS[k]).is_file() for k in kernels):
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(lib_root / "include", tmp / "include")
        for k, text in texts.items():
            (tmp / "include" / HEADERS[k]).write_text(text)
        try:
            tmp.rename(root)
        except OSError:  # another process made it first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    module._C.init(str(root), module._find_cuda_home())
    return None


def restore(module) -> None:
    """Point DeepGEMM's JIT back at the module's own include tree."""
    module._C.init(str(Path(module.__file__).resolve().parent), module._find_cuda_home())
