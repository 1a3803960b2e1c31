"""The actor optimizer's settings (`optim` section of a run config), apart from `train_step` so that a config loads
without importing megatron-core (a config error then takes about a second)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimConfig:
    """The actor optimizer (megatron `OptimizerConfig` subset)."""

    lr: float = 1e-6
    """Learning rate (constant; schedule it by setting `param_groups[i]['lr']`)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0: off)."""
    bf16: bool = True
    """BF16 params with FP32 main params (megatron's mixed-precision optimizer; on CPU through the patch in
    patches/). The batch-invariant actor needs it to reproduce the rollout engine's BF16 forward."""
    distributed: bool = False
    """megatron's DistributedOptimizer (ZeRO-1): gradients are reduce-scattered, each DP rank keeps the FP32 main
    params and Adam moments of its 1/DP of the parameters only, and the updated params are all-gathered. Same
    update as the replicated optimizer up to the grad-norm summation order; checkpoints hold the state gathered
    in megatron's DP-size-independent `dp_zero` format. A run config may say `auto` (the model presets do): on where
    `parallel.dp > 1`; at DP 1 it would shard nothing, and megatron's mixed-precision optimizer lets jetrl free its
    linears' BF16 weights through each step (`model.bf16_linear_weights`)."""
    fused: bool = True
    """On CUDA, step megatron's torch Adam (its choice without TE or apex) as torch's fused Adam: one kernel instead
    of seven passes over the FP32 state (`use_fused_adam`). False: the foreach Adam megatron builds. TE's and
    apex's Adam are fused either way; the CPU runs foreach."""
    wgrad_fusion: bool = True
    """On CUDA, megatron's BF16 linears (bf16 mode's, and the lm_head in every mode) add their weight gradient into
    the FP32 `main_grad` inside the WGrad GEMM (megatron's gradient accumulation fusion, through cuBLAS instead of
    apex: `actor.wgrad_fusion`), as the FP8 linears do. False: a BF16 gradient, then DDP's separate add. The CPU
    keeps the separate add."""

    def __post_init__(self):
        import math

        problems = []
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            problems.append(f"clip_grad must be finite and >= 0 (0: off), got {self.clip_grad}")
        if problems:
            raise ValueError("; ".join(problems))
