"""vLLM 0.26.0: the number of requests a V1 scheduler has preempted, counted on that scheduler.

Why: an engine whose KV cache cannot hold all of a step's sequences at their full length starts them all while they are
short; once the cache is full the scheduler preempts the newest (`Scheduler._preempt_request` in
`vllm/v1/core/sched/scheduler.py`: its blocks are freed and it is recomputed later from its tokens so far). Each
preemption costs a prefill of everything that sequence had decoded, so a rollout's time depends on how many there were.
vLLM counts them only in its stats loggers (`IterationStats.num_preempted_reqs`), which `vllm.LLM` does not build
(`disable_log_stats=True`, its default), and a finished request, which carries its own `num_preemptions`, is dropped.

The change: `apply(scheduler)` wraps that one scheduler instance's `_preempt_request` so that it also adds 1 to
`scheduler.jetrl_preemptions` (0 from the call on). Nothing else changes; other schedulers and the class are
untouched. `VllmEngine` applies it to its in-process engine core's scheduler (`rollout.colocated`: the external
launcher runs the engine core in the trainer's process) and reads the count around each `generate`.
"""

from __future__ import annotations

from megatron_jetrl.patching import load_patch

TARGET_VERSION = "0.26.0"


def apply(scheduler) -> None:
    """Count `scheduler`'s preemptions in `scheduler.jetrl_preemptions`; refuses another vLLM; safe to call again."""
    load_patch("vllm_0_26_0_seeded_sampling").require_vllm(
        "vllm_0_26_0_preemption_count", "wraps Scheduler._preempt_request", TARGET_VERSION
    )
    if hasattr(scheduler, "jetrl_preemptions"):
        return
    preempt = scheduler._preempt_request
    scheduler.jetrl_preemptions = 0

    def counted(request, timestamp):
        scheduler.jetrl_preemptions += 1
        return preempt(request, timestamp)

    scheduler._preempt_request = counted
