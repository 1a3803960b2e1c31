"""vLLM 0.26.0: the tensor-parallel all-reduce above TP 2 as `megatron_jetrl.models.ordered_reduce` (rank order, FP32, one
rounding), the sum the actor's row-parallel linears take.

Why: `precision.exact_logprobs` needs a row-parallel linear's output to be the same bytes in the engine and in the
actor. Up to TP 2 that output is one addition of two partial sums, the same in any order. Above it vLLM adds the
partial sums in its custom all-reduce kernels or NCCL's ring or tree, in orders the trainer's NCCL all-reduce does not
share, so the two round differently.

The change: `vllm.distributed.parallel_state.GroupCoordinator._all_reduce_out_place` (every TP all-reduce of the
model's forward goes through it, with or without vLLM's custom-op call) is wrapped: a group of more than two ranks
all-gathers the partial sums through its device communicator (NCCL through pynccl, which CUDA graphs capture) and adds
them in rank order with `ordered_sum`; groups of one or two ranks call vLLM's own all-reduce. Apply before the engine
starts. `VllmEngine` applies it under `exact_logprobs` at rollout TP > 2 and refuses to start where it did not take.
"""

from __future__ import annotations

import functools

from megatron_jetrl.patching import load_patch

TARGET_VERSION = "0.26.0"


def _coordinator():
    from vllm.distributed import parallel_state

    return parallel_state.GroupCoordinator


def applied() -> bool:
    """Whether vLLM's TP all-reduce runs through this patch."""
    return getattr(_coordinator()._all_reduce_out_place, "jetrl_ordered", False)


def apply() -> bool:
    """Wrap vLLM 0.26.0's all-reduce (see above). Raises `VllmVersionError` for another vLLM; safe to call again."""
    from megatron_jetrl.models.ordered_reduce import ordered_sum

    load_patch("vllm_0_26_0_seeded_sampling").require_vllm(
        "vllm_0_26_0_ordered_all_reduce", "wraps GroupCoordinator._all_reduce_out_place", TARGET_VERSION
    )
    if applied():
        return True
    coordinator = _coordinator()
    reduce = coordinator._all_reduce_out_place

    @functools.wraps(reduce)
    def in_rank_order(self, input_):
        if self.world_size <= 2:
            return reduce(self, input_)
        parts = self.device_communicator.all_gather(input_.contiguous(), 0)
        return ordered_sum(parts.view(self.world_size, *input_.shape))

    in_rank_order.jetrl_ordered = True
    in_rank_order.jetrl_original = reduce
    coordinator._all_reduce_out_place = in_rank_order
    return True


def revert() -> None:
    """vLLM's own all-reduce again (tests)."""
    coordinator = _coordinator()
    if applied():
        coordinator._all_reduce_out_place = coordinator._all_reduce_out_place.jetrl_original
