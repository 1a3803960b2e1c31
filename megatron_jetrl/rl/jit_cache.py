"""Compiled-kernel caches: where DeepGEMM and Triton keep the kernels they compile, and progress while they compile
(`rl.warm_cache` compiles a config's kernels ahead of its run).

A cold FP8 run compiles DeepGEMM's GEMMs on first use (the actor's FProp, DGrad and WGrad at its shapes, the vLLM
engine's at its decode batch sizes) and Triton compiles the quantizers: minutes at Qwen3-8B shapes (BENCHMARKS.md,
"Weight sync and start-up"). They are files keyed by source, shape class and flags, valid on every GPU of one
architecture with the same DeepGEMM, Triton and nvcc, so they compile once per machine -- or once per cluster, with
`run.jit_cache_dir` on shared storage -- and every later run starts warm. `run.jit_cache_dir` puts both caches under
one directory (`deep_gemm/` as DG_JIT_CACHE_DIR, `triton/` as TRITON_CACHE_DIR) for the trainer and the vLLM engines
alike; left empty, DG_JIT_CACHE_DIR (if set) or vLLM's own default (~/.cache/vllm/deep_gemm) serves both, and Triton
keeps its default.

While a run compiles, rank 0 says so every `PROGRESS_S` seconds (kernels so far, seconds, where they go) instead of
going silent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

PROGRESS_S = 15.0


def cache_dirs(jit_cache_dir: str) -> dict[str, Path | None]:
    """{"deep_gemm": its kernel cache, "triton": its cache or None (Triton's default)} for `run.jit_cache_dir`."""
    if jit_cache_dir:
        root = Path(jit_cache_dir).expanduser()
        return {"deep_gemm": root / "deep_gemm", "triton": root / "triton"}
    vllm_root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vllm")
    deep_gemm = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(vllm_root, "deep_gemm")
    triton = os.environ.get("TRITON_CACHE_DIR")
    return {"deep_gemm": Path(deep_gemm).expanduser(), "triton": Path(triton).expanduser() if triton else None}


def pin_cache_dirs(jit_cache_dir: str) -> dict[str, Path | None]:
    """Point DeepGEMM (trainer and vLLM: they share a process) and Triton at `cache_dirs`, before either is imported."""
    dirs = cache_dirs(jit_cache_dir)
    os.environ["DG_JIT_CACHE_DIR"] = str(dirs["deep_gemm"])
    if dirs["triton"] is not None:
        os.environ["TRITON_CACHE_DIR"] = str(dirs["triton"])
    return dirs


def count_kernels(dirs: dict[str, Path | None]) -> int:
    """Compiled kernels in the caches: one directory each under DeepGEMM's `cache/` and Triton's cache."""
    n = 0
    for path in (dirs["deep_gemm"] / "cache" if dirs["deep_gemm"] else None, dirs["triton"]):
        if path is not None and path.is_dir():
            n += sum(1 for e in os.scandir(path) if e.is_dir())
    return n


class CompileProgress(threading.Thread):
    """Says, every `interval` seconds in which kernels were added, how many have been compiled so far and where."""

    def __init__(self, dirs: dict[str, Path | None], interval: float = PROGRESS_S, out=sys.stderr):
        super().__init__(daemon=True, name="jit-progress")
        self.dirs, self.interval, self.out = dirs, interval, out
        self.start_count = self.last = count_kernels(dirs)
        self.t0 = time.monotonic()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.report()

    def report(self) -> None:
        n = count_kernels(self.dirs)
        if n > self.last:
            where = self.dirs["deep_gemm"] if self.dirs["triton"] is None else self.dirs["deep_gemm"].parent
            print(
                f"compiling GPU kernels (first use of these shapes): {n - self.start_count} new in "
                f"{time.monotonic() - self.t0:.0f} s, cached in {where}; `megatron_jetrl.rl.warm_cache` compiles a "
                "config's kernels ahead of its run",
                file=self.out,
                flush=True,
            )
            self.last = n

    def stop(self) -> None:
        self._done.set()
