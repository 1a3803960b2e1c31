"""vLLM 0.26.0: FlashAttention with one KV split and no ahead-of-time scheduler, without the process-wide batch-invariant mode.

Why: `precision.exact_logprobs` needs vLLM's attention to give a query the same bytes in whatever batch it runs: FA3
with one KV split (`actor.rollout_kernels`). vLLM 0.26.0 does that only in its batch-invariant mode
(`VLLM_BATCH_INVARIANT=1`), which also, for the whole process and so for the colocated trainer too:
- replaces aten's softmax, _log_softmax, mean.dim and bmm with Triton kernels (`model_executor/layers/batch_invariant.py`;
  the sampler's softmax over [256, 151936] FP32: 0.50 ms against torch's 0.22 ms on an H100, tools/bench/bench_exact.py);
- runs the unquantized linears and the lm_head in a persistent Triton GEMM (1.3x cuBLAS's time at 8192 rows);
- shrinks cuBLAS's workspace, turns TF32 off and pins NCCL to one channel, one thread and tree all-reduce.
An FP8 rollout needs none of that for its logprobs: its linears are DeepGEMM's (batch-invariant), norm and RoPE the
trainer's, and its lm_head the GEMM the actor runs (`rollout_kernels.lm_head_gemm`, put in by `rollout.vllm_glue`).

The change: `vllm/v1/attention/backends/flash_attn.py` reads `envs.VLLM_BATCH_INVARIANT` for exactly this (the metadata
builder's `max_num_splits = 1` and no AOT schedule, `FlashAttentionImpl.batch_invariant_enabled` read at construction,
the cascade kernels' `num_splits=1`). `apply()` gives that one module a view of `vllm.envs` in which
`VLLM_BATCH_INVARIANT` is true; every other name resolves in `vllm.envs` itself. Apply before the engine builds its
attention layers. Cascade attention is turned off by the engine's arguments (`disable_cascade_attn`), which is what
the batch-invariant mode does too. `VllmEngine` applies it under `exact_logprobs` with an FP8 rollout and reads the
result back from every attention layer at start-up. Each launch then prepares its own FA3 schedule instead of the one
the builder would make ahead of time once a step: the same bytes, and no time measured either way (kernel and
engine, BENCHMARKS.md: FP8 KV cache), so the patch keeps the simple form.
"""

from __future__ import annotations

import importlib
import types

from megatron_jetrl.patching import load_patch

TARGET_VERSION = "0.26.0"
MODULE = "vllm.v1.attention.backends.flash_attn"


class _OneSplitEnvs(types.ModuleType):
    """`vllm.envs` as the FlashAttention backend sees it: `VLLM_BATCH_INVARIANT` true, everything else vLLM's."""

    def __init__(self, envs):
        super().__init__("vllm.envs (one-split attention)")
        self._envs = envs

    def __getattr__(self, name):
        if name == "VLLM_BATCH_INVARIANT":
            return True
        return getattr(self._envs, name)


def applied() -> bool:
    """Whether vLLM's FlashAttention backend runs with one KV split through this patch."""
    module = importlib.import_module(MODULE)
    return isinstance(module.envs, _OneSplitEnvs)


def apply() -> bool:
    """Give vLLM 0.26.0's FlashAttention backend one KV split. Raises `VllmVersionError` for another vLLM; safe to call again."""
    load_patch("vllm_0_26_0_seeded_sampling").require_vllm("vllm_0_26_0_one_split_attention", f"reads {MODULE}", TARGET_VERSION)
    module = importlib.import_module(MODULE)
    if not isinstance(module.envs, _OneSplitEnvs):
        module.envs = _OneSplitEnvs(module.envs)
    return True
