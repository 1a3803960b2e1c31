"""Triton launches without Triton's per-call host work (matched against Triton 3.6.0, `triton/runtime/jit.py`).

`kernel[grid](*args, **kw)` through `JITFunction.run` binds the arguments, specializes each one, formats the options
into the cache key and builds launch metadata on every call: ~40 us of host time per launch on the GPU machine's
CPU (measured, BENCHMARKS.md), against ~25 us for a whole DeepGEMM GEMM. The FP8 linear and megatron's glue issue
a dozen such launches per layer, enough to leave the GPU waiting on the host at 4096-token micro-batches.

`Launcher(fn)[grid](*args, **kw)` is the same launch. The first call of each *specialization* goes through Triton
(compiling if needed) and keeps the compiled kernel under a key that holds everything Triton specializes on and
more: each tensor's dtype and 16-byte alignment; each int's 32/64-bit range, divisibility by 16 and equality to 1;
the type of every other argument; every keyword (constexprs, `num_warps`); the device. Later calls with that key
call the compiled kernel's launcher directly, with the arguments in signature order as Triton passes them. A
key can only be finer than Triton's, never coarser, so a kernel never runs on arguments it was not compiled for.
Arguments of other types (a TMA `TensorDescriptor`), a callable grid, or a Triton launch hook (profilers such as
proton set one) take Triton's own path on every call.
"""

from __future__ import annotations

import torch


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


class Launcher:
    """A `triton.jit` function launched as `Launcher(fn)[grid](*args, **kw)`; see the module docstring."""

    def __init__(self, fn):
        self.fn = fn
        self._params = list(fn.signature.parameters.values())
        self._cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args, kw):
        from triton import knobs

        if callable(grid) or knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
            return self.fn[grid](*args, **kw)
        device = torch.cuda.current_device()
        try:
            key = (device, tuple(map(_spec, args)), tuple(kw.items()))
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
