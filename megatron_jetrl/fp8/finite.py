"""Non-finite quantizer inputs, found on the device and reported once per step (`PrecisionFlow.check_finite`).

E4M3 has no inf, and a NaN/Inf group gives a NaN/Inf scale (see `megatron_jetrl.fp8`), so a quantization's
input was finite exactly when the largest of its scales is finite. The three modes:

    sync  each quantization checks its scales and raises `NonFiniteInputError` naming the element: one host
          sync per quantization (debugging; what the CPU reference does anyway)
    step  each quantization appends the max of its scales -- one small reduction, no sync -- to the active
          `FiniteWatch`; `train_step` opens one around forward+backward and checks it with the loss and the
          gradients in the step's single finiteness sync, naming the first layer and tensor whose input was
          not finite. Outside a watch nothing is recorded, and a NaN/Inf propagates as NaN (never as 448).
    off   nothing is checked (NaN/Inf still propagates as NaN)

The active watch is process-wide, not per thread: autograd runs CUDA backward on its own device threads.
"""

from __future__ import annotations

import contextlib

import torch

CHECK_MODES = ("step", "sync", "off")


class FiniteWatch:
    """Device-side record of every quantization of one step: its site name and the max of its scales."""

    LIMIT = 1 << 16
    """Records kept before the watch checks itself (one host sync) to bound its memory."""

    def __init__(self):
        self._sites: list[str] = []
        self._maxes: list[torch.Tensor] = []
        self._found: str | None = None

    def record(self, site: str, scales: torch.Tensor) -> None:
        if self._found is not None or scales.numel() == 0:
            return
        self._sites.append(site)
        self._maxes.append(scales.detach().amax())  # NaN and Inf survive amax; finite scales stay finite
        if len(self._maxes) >= self.LIMIT:
            self._found = self.first_problem()
            self._sites, self._maxes = [], []

    def finite(self) -> torch.Tensor | None:
        """A device bool: every recorded input was finite (None when nothing was recorded). No host sync."""
        if not self._maxes:
            return None
        return torch.isfinite(torch.stack(self._maxes)).all()

    def first_problem(self) -> str | None:
        """The first recorded site whose input held NaN/Inf (one host sync), or None."""
        if self._found is not None or not self._maxes:
            return self._found
        bad = (~torch.isfinite(torch.stack(self._maxes))).nonzero()
        if bad.numel() == 0:
            return None
        first = int(bad[0, 0])
        value = self._maxes[first].item()
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
