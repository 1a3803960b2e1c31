"""vLLM 0.26.0: FlashAttention 3's FP8 forward always on its two-warpgroup kernel, whatever the batch.

Why: with an FP8 KV cache (`precision.kv_cache: fp8`) vLLM runs FA3's FP8 forward, and FA3 (vLLM's build) picks a
kernel on one MMA warpgroup with a 64-row tile when `max_seqlen_q * heads / kv_heads <= 64` -- a pure decode batch --
and its two-warpgroup kernel otherwise. In BF16 the two give the same bytes; in FP8 they do not (about 1 output in 12
differs, H200, Qwen3-8B heads: tools/gpu/probe_fp8_attention.py). A decode token's attention would then depend on
whether a prefill shared its step, and the actor's forward over whole sequences (`actor.rollout_kernels`) could not
match it. The launch's `max_seqlen_q` only sizes the grid and picks the kernel; each sequence's own query count comes
from `cu_seqlens_q`.

The change: the FlashAttention backend module's `flash_attn_varlen_func` is wrapped so that an FP8 query launches
with `max_seqlen_q` at least `actor.rollout_kernels.fp8_attention_min_q(heads, kv_heads)`, the least at which FA3
takes the two-warpgroup kernel; BF16 calls pass through unchanged. The actor launches with the same floor. The
module's `get_scheduler_metadata` (the schedule the metadata builder makes ahead of time, once a step, whose tiles
follow from `max_seqlen_q`) gets the same floor for an FP8 `qkv_dtype`, so that such a schedule is the floored
launch's: the one-split pin turns it off, but the tile pin alone (tools/bench/bench_vllm.py --pins fp8-tile) keeps
it. Apply before the engine captures its CUDA graphs. `VllmEngine` applies it under `exact_logprobs` with an FP8 KV
cache.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from megatron_jetrl.patching import load_patch

TARGET_VERSION = "0.26.0"
MODULE = "vllm.v1.attention.backends.flash_attn"


def applied() -> bool:
    """Whether vLLM's FlashAttention backend launches FP8 attention through this patch."""
    module = importlib.import_module(MODULE)
    return all(
        getattr(getattr(module, f, None), "jetrl_fp8_tile", False) for f in ("flash_attn_varlen_func", "get_scheduler_metadata")
    )


def apply() -> bool:
    """Wrap vLLM 0.26.0's FlashAttention launch (see above). Raises `VllmVersionError` for another vLLM; safe to call again."""
    import torch

    from megatron_jetrl.actor.rollout_kernels import fp8_attention_min_q

    load_patch("vllm_0_26_0_seeded_sampling").require_vllm(
        "vllm_0_26_0_fp8_attention_tile", f"wraps {MODULE}'s flash_attn_varlen_func", TARGET_VERSION
    )
    module = importlib.import_module(MODULE)
    if applied():
        return True
    launch = module.flash_attn_varlen_func

    @functools.wraps(launch)
    def two_warpgroups(q, k, v, max_seqlen_q, *args, **kwargs):
        if q.dtype == torch.float8_e4m3fn:
            max_seqlen_q = max(max_seqlen_q, fp8_attention_min_q(q.shape[-2], k.shape[-2]))
        return launch(q, k, v, max_seqlen_q, *args, **kwargs)

    make = module.get_scheduler_metadata
    signature = inspect.signature(make)

    @functools.wraps(make)
    def two_warpgroup_schedule(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["qkv_dtype"] == torch.float8_e4m3fn:
            a["max_seqlen_q"] = max(a["max_seqlen_q"], fp8_attention_min_q(a["num_heads_q"], a["num_heads_kv"]))
        return make(*bound.args, **bound.kwargs)

    two_warpgroups.jetrl_fp8_tile = two_warpgroup_schedule.jetrl_fp8_tile = True
    module.flash_attn_varlen_func = two_warpgroups
    module.get_scheduler_metadata = two_warpgroup_schedule
    return True
