"""Non-finite quantizer inputs, found on the device and reported once per step (`PrecisionFlow.check_finite`).

E4M3 has no inf, and a NaN/Inf group gives a NaN/Inf scale (see `megatron_jetrl.fp8`), so a quantization's
input was finite exactly when the largest of its scales is finite. The three modes:

    sync  each quantization checks its scales and raises `NonFiniteInputError` naming the element: one host
          sync per quantization (debugging; what the CPU reference does anyway)
    step  each quantization hands its scales to the active `FiniteWatch` (no sync, no launch: the watch
          reduces them `CHUNK` at a time in one multi-tensor kernel to the sum of |scale| per quantization,
          which is NaN/Inf exactly when a scale is); `train_step` opens one around forward+backward and checks
          it with the loss and the gradients in the step's single finiteness sync, naming the first layer and
          tensor whose input was not finite. Outside a watch nothing is recorded, and a NaN/Inf propagates as
          NaN (never as 448).
    off   nothing is checked (NaN/Inf still propagates as NaN)

The active watch is process-wide, not per thread: autograd runs CUDA backward on its own device threads.
"""

from __future__ import annotations

import contextlib

import torch

CHECK_MODES = ("step", "sync", "off")


class FiniteWatch:
    """Device-side record of every quantization of one step: its site name and the sum of |scales|.

    A reduction per quantization would cost a kernel launch of host time (three per FP8 linear fwd+bwd);
    the watch holds the scales of up to `CHUNK` quantizations and reduces them together with `torch._foreach_norm`
    (ord 1, FP32: NaN and Inf survive the sum; finite scales could only sum past FP32's range for inputs near
    1e33, far beyond anything BF16 training survives)."""

    LIMIT = 1 << 16
    """Records kept before the watch checks itself (one host sync) to bound its memory."""
    CHUNK = 16
    """Scale tensors held before one reduction. Each is 1/64 of its BF16 input's bytes (one FP32 per 128 elements):
    1 MiB for dY of a Qwen3-8B o or down projection at 8192 tokens, 6 MiB for gate_up's; holding them delays their
    release by at most 16 quantizations (about two layers' fwd+bwd)."""

    def __init__(self):
        self._sites: list[str] = []
        self._sums: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []
        self._found: str | None = None

    def record(self, site: str, scales: torch.Tensor) -> None:
        if self._found is not None or scales.numel() == 0:
            return
        self._sites.append(site)
        scales = scales.detach()
        if scales.dim() == 2 and not scales.is_contiguous() and scales.t().is_contiguous():
            scales = scales.t()  # the same values, dense: the multi-tensor kernel's fast path
        self._pending.append(scales)
        if len(self._pending) >= self.CHUNK:
            self._reduce()
            if len(self._sums) >= self.LIMIT:
                self._found = self.first_problem()
                self._sites, self._sums = [], []

    def _reduce(self) -> None:
        if self._pending:
            self._sums.extend(torch._foreach_norm(self._pending, 1))
            self._pending = []

    def finite(self) -> torch.Tensor | None:
        """A device bool: every recorded input was finite (None when nothing was recorded). No host sync."""
        self._reduce()
        if not self._sums:
            return None
        return torch.isfinite(torch.stack(self._sums)).all()

    def summary(self) -> torch.Tensor | None:
        """One FP32 device scalar, NaN/Inf exactly when a recorded input was (the sum of the records' sums; no host
        sync), or None when nothing was recorded. A CUDA graph records its quantizations into a watch of its own during
        capture and keeps this scalar, which each replay rewrites (`actor.layer_graphs`)."""
        self._reduce()
        return torch.stack(self._sums).sum() if self._sums else None

    def first_problem(self) -> str | None:
        """The first recorded site whose input held NaN/Inf (one host sync), or None."""
        self._reduce()
        if self._found is not None or not self._sums:
            return self._found
        bad = (~torch.isfinite(torch.stack(self._sums))).nonzero()
        if bad.numel() == 0:
            return None
        first = int(bad[0, 0])
        value = self._sums[first].item()
        return f"{self._sites[first]} ({'NaN' if value != value else 'Inf'}; first of {bad.shape[0]} non-finite FP8 quantizer input(s))"

    def check(self) -> None:
        """Raise `NonFiniteInputError` naming the first non-finite site, if any."""
        from megatron_jetrl.fp8.quant import NonFiniteInputError

        problem = self.first_problem()
        if problem is not None:
            raise NonFiniteInputError(f"NaN/Inf reached the FP8 quantizer: {problem}")


_ACTIVE: FiniteWatch | None = None


@contextlib.contextmanager
def watch():
    """Make a fresh `FiniteWatch` the active one for the block (nests: the outer one is restored after)."""
    global _ACTIVE
    outer, _ACTIVE = _ACTIVE, FiniteWatch()
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = outer


def active() -> bool:
    """Whether a watch is recording."""
    return _ACTIVE is not None


def record(site: str, scales: torch.Tensor) -> None:
    """Record a quantization's scales in the active watch (nothing outside a watch)."""
    if _ACTIVE is not None:
        _ACTIVE.record(site, scales)
