"""Group-relative advantages (GRPO): each completion is scored against the other samples of its prompt."""

from __future__ import annotations

import torch

SCALES = ("std", "none")


def group_advantages(rewards: torch.Tensor, n: int, *, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Advantages of `rewards` laid out as P prompts x `n` samples (prompt-major: `[p0s0, p0s1, ..., p1s0, ...]`).

    `scale="std"` (GRPO): `(r - mean_g) / (std_g + eps)` per group g. The std is the population std
    (`unbiased=False`), so advantages are the z-scores of the group (for binary rewards with k of n correct:
    +sqrt((n-k)/k) and -sqrt(k/(n-k))). verl and TRL divide by the unbiased std instead, which makes their
    advantages smaller by sqrt((n-1)/n) (0.87 at n=4, 0.97 at n=16).
    `scale="none"` (Dr. GRPO): `r - mean_g`, no division.

    A group whose rewards are all equal gets exactly 0 (no learning signal, and no `0/eps` noise). Computed
    in FP64 and returned in the rewards' floating dtype (FP32 for integer or bool rewards).
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}: use one of {SCALES}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [prompts * n], got shape {tuple(rewards.shape)}: flatten the prompt x sample grid prompt-major"
        )
    if n < 2:
        raise ValueError(f"n (samples per prompt) must be >= 2 for group-relative advantages, got {n}")
    if rewards.numel() == 0 or rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}: pass prompts * n rewards")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    groups = rewards.detach().to(torch.float64).view(-1, n)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale == "std":
        # The std is taken on a unit scale (each group divided by its largest |r - mean|): squaring the raw
        # spread underflows to 0 below ~1e-154 (and overflows above ~1e154), which would turn z-scores into inf.
        unit = centered.abs().amax(dim=1, keepdim=True)
        unit = torch.where(unit > 0, unit, 1.0)
        std = (centered / unit).square().mean(dim=1, keepdim=True).sqrt() * unit
        centered = centered / (std + eps)
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(constant, 0.0, centered).view(-1).to(out_dtype)
