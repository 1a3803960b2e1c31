"""Triton launches without Triton's per-call host work (matched against Triton 3.6.0, `triton/runtime/jit.py`).

`kernel[grid](*args, **kw)` through `JITFunction.run` binds the arguments, specializes each one, formats the options
into the cache key, builds launch metadata and calls the (empty) launch-hook chains on every call: on the host a
`quantize_1x128` then costs more than a whole DeepGEMM GEMM (BENCHMARKS.md).
The FP8 linear and megatron's glue issue about 17 such launches per layer fwd+bwd, and at 4096-token micro-batches
the GPU then waits on the host.

`Launcher(fn)[grid](*args, **kw)` is the same launch. The first call of each *specialization* goes through Triton
(compiling if needed) and keeps the compiled kernel under a key that holds everything Triton specializes on and
more: each tensor's dtype and 16-byte alignment; each int's 32/64-bit range, divisibility by 16 and equality to 1;
the type of every other argument; the value of every constexpr and every keyword (`num_warps`); the device. Later calls with that key
call the compiled kernel's launcher directly, as `JITFunction.run` ends: the arguments in signature order
(positional, then each remaining parameter's keyword or default), no launch metadata and no hooks (the C launcher
skips `None` hooks). A key can only be finer than Triton's, never coarser, so a kernel never runs on arguments it
was not compiled for.

Triton's own path is taken, on every call, for arguments of other types (a TMA `TensorDescriptor`), a callable grid,
a registered launch hook (profilers such as proton add one), and everywhere if the first-use probe fails: once per
process, a small kernel is launched both ways over every specialization kind above, and the direct launch is used
only if it writes the same bytes as Triton's (as `fp8.backends.self_test` checks a GEMM backend before first use;
launches made before the probe could run -- inside a CUDA graph capture or under torch's sync debug mode, since the
probe syncs -- take Triton's path). `MEGATRON_JETRL_TRITON_LAUNCH=triton` in the environment turns the direct launch off
for the process (an escape hatch, and the A/B of tools/bench/bench_host.py); `direct`, the default, leaves it to the probe.
"""

from __future__ import annotations

import os
import warnings

import torch

ENV = "MEGATRON_JETRL_TRITON_LAUNCH"

_DIRECT: bool | None = None
"""The probe's verdict for this process: None until the first launch."""


class _Slow(Exception):
    """An argument this launcher does not key: the launch goes through Triton."""


def _spec(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31, -(2**63) <= a < 2**63
    if isinstance(a, float):
        return float
    if a is None:
        return None
    raise _Slow


def _hooks_active() -> bool:
    """Whether a Triton launch hook is registered (Triton 3.6 keeps them in `HookChain`s, empty by default)."""
    from triton import knobs

    return any(
        bool(getattr(h, "calls", h is not None)) for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    )


class Launcher:
    """A `triton.jit` function launched as `Launcher(fn)[grid](*args, **kw)`; see the module docstring."""

    def __init__(self, fn):
        self.fn = fn
        self._params = list(fn.signature.parameters.values())
        self._constexpr = tuple("constexpr" in str(p.annotation) for p in self._params)  # Triton's KernelParam.is_constexpr
        self._cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args, kw, *, direct: bool | None = None):
        if callable(grid) or not (direct if direct is not None else _direct_ok()) or _hooks_active():
            return self.fn[grid](*args, **kw)
        device = torch.cuda.current_device()
        try:
            key = (device, tuple(a if c else _spec(a) for a, c in zip(args, self._constexpr)), tuple(kw.items()))
            hit = self._cache.get(key)
        except (_Slow, TypeError):  # TypeError: an unhashable keyword value
            return self.fn[grid](*args, **kw)
        if hit is None:
            kernel = self.fn[grid](*args, **kw)
            self._cache[key] = (kernel, self._tail(len(args), kw))
            return kernel
        kernel, tail = hit
        g = tuple(grid) + (1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
        return kernel

    def _tail(self, n_positional: int, kw: dict) -> tuple:
        """The signature's parameters after the positional ones, in order: the keyword or else the default."""
        tail = []
        for p in self._params[n_positional:]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.default is not p.empty:
                tail.append(p.default)
            else:
                raise TypeError(f"{getattr(self.fn, '__name__', 'kernel')}: no value for parameter {p.name!r}")
        return tuple(tail)


def _direct_ok() -> bool:
    global _DIRECT
    if _DIRECT is None:
        choice = os.environ.get(ENV, "direct")
        if choice not in ("direct", "triton"):
            raise ValueError(
                f"{ENV}={choice!r}: use 'direct' (the default: cached direct launches, checked once) or 'triton' "
                "(every launch through JITFunction.run)"
            )
        if choice == "triton":
            _DIRECT = False
            return False
        if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode():  # the probe syncs: not now
            return False
        try:
            _DIRECT = _probe()
        except Exception as e:  # noqa: BLE001 -- any surprise in Triton's internals: use Triton's own path
            _DIRECT = False
            warnings.warn(
                f"Triton launches go through JITFunction.run: the direct-launch probe failed ({type(e).__name__}: "
                f"{str(e)[:200]})",
                RuntimeWarning,
                stacklevel=3,
            )
    return _DIRECT


def _probe() -> bool:
    """Launch a small kernel through Triton and directly (the second call of each key), over aligned and unaligned
    pointers, ints equal to 1, divisible by 16 or neither, a float, a default and two constexprs: True if every
    direct launch wrote Triton's bytes."""
    fast = Launcher(_probe_kernel())
    base = torch.arange(9000, device="cuda", dtype=torch.float32).sin()
    y = torch.randn(9000, device="cuda")
    for off in (0, 1):
        for n in (1, 16, 1000):
            for stride in (1, 3):
                x = base[off:]
                want = torch.full((n,), float("nan"), device="cuda")
                fast.fn[(-(-n // 256),)](x, y, want, n, stride, 0.5, SCALE=2.0, BLOCK=256)
                for _ in range(2):  # fills the key, then the direct launch
                    got = torch.full((n,), float("nan"), device="cuda")
                    fast.launch((-(-n // 256),), (x, y, got, n, stride, 0.5), {"SCALE": 2.0, "BLOCK": 256}, direct=True)
                    if not torch.equal(got, want):
                        raise RuntimeError(
                            f"the direct launch wrote other values than Triton's (offset {off}, n {n}, stride {stride})"
                        )
    return True


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, y_ptr, out_ptr, n, stride, a, SCALE: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr = 1.0):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs * stride, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, (a * x + y) * SCALE + ADD, mask=mask)

    return probe
