"""The TP sum in rank order (`models.ordered_reduce`) that the actor's row-parallel linears and vLLM's all-reduce
(patches/vllm_0_26_0_ordered_all_reduce.py) share under `precision.exact_logprobs` above TP 2.

Its bytes are those of adding the partial sums in rank order in FP32 and rounding once, on every rank; the actor at
TP 4 with it trains as with megatron's all-reduce within BF16 rounding; the vLLM patch, on a stand-in coordinator
(CPU: no vLLM), sums groups of more than two ranks the same way and leaves smaller ones to vLLM. On GPUs:
tests/gpu/test_exact_logprobs.py (TP 4, mismatch exactly 0).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from actor_helpers import CONFIGS, spawn, tokens_for
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.models.ordered_reduce import ordered_sum
from megatron_jetrl.patching import load_patch


def _by_hand(parts: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(parts.shape[1:], dtype=torch.float32)
    for part in parts:
        total = total + part.float()
    return total.to(parts.dtype)


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 8),
    n=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_ordered_sum_adds_in_rank_order_in_fp32_and_rounds_once(world, n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    parts = (torch.randn(world, n, generator=g) * torch.logspace(-3, 3, n)).to(dtype)
    got = ordered_sum(parts)
    assert got.dtype == dtype and torch.equal(got, _by_hand(parts))
    if world > 2 and dtype == torch.bfloat16:  # another order may round otherwise: the order is part of the result
        assert torch.equal(ordered_sum(parts), ordered_sum(parts.clone()))


def _gathered(x, group):
    """Every rank's `x` stacked in rank order: `[world, *x.shape]`."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def _on_a_tp4_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.fp8_layers import use_ordered_reduce
    from megatron_jetrl.actor.hf_import import init_hf_weights
    from megatron_jetrl.actor.logprobs import compute_logprobs
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch
    from megatron_jetrl.models.ordered_reduce import OrderedAllReduce, ordered_all_reduce

    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(7 + rank)
    x = (torch.randn(5, 3, 64, generator=g) * 10 ** torch.linspace(-2, 2, 64)).to(torch.bfloat16)
    parts = _gathered(x, group)
    summed = ordered_all_reduce(x, group)
    three = dist.new_group([0, 1, 2])  # (every rank makes the group; ranks 0-2 sum over it)
    shapes = {}  # shape -> whether every (group, dtype) summed it as the gathered partials' ordered_sum, to the bit
    for shape in [(5, 3, 64), (7, 13), (1,), (0, 4), (3, 4096)]:
        shapes[shape] = True
        for grp, dtype in ((group, torch.bfloat16), (group, torch.float32), (three, torch.bfloat16)):
            if grp is three and rank > 2:
                continue
            y = (torch.randn(shape, generator=g) * 100).to(dtype)
            got = ordered_all_reduce(y, grp)
            shapes[shape] &= got.shape == y.shape and got.dtype == dtype and torch.equal(got, ordered_sum(_gathered(y, grp)))
    leaf = x.clone().requires_grad_(True)
    OrderedAllReduce.apply(leaf, group).backward(torch.ones_like(x))

    config = dict(CONFIGS["qwen3"], hidden_size=512, num_key_value_heads=4)  # TP 4: one KV head and 128 columns a rank
    arch = ModelArch.from_hf_config(config)
    tokens = tokens_for(config, batch=2, seed=1)
    logprobs = {}
    for ordered in (False, True):
        model = build_model(arch, PrecisionFlow(mode="jetrl", backend="emulated"), ActorOptions(ordered_reduce=ordered))
        init_hf_weights(model, arch, 3)
        logprobs[ordered] = compute_logprobs(model, tokens, vocab_size=arch.vocab_size, micro_batch_size=2)
    refused = None
    try:
        use_ordered_reduce(build_model(arch, PrecisionFlow(mode="bf16"), ActorOptions()))
    except ValueError as e:
        refused = str(e)
    return {
        "ordered": torch.equal(summed, ordered_sum(parts)),
        "shapes": shapes,
        "summed": summed,
        "grad_passes": torch.equal(leaf.grad, torch.ones_like(x)),
        "logprobs": logprobs,
        "refused": refused,
    }


@pytest.fixture(scope="module")
def tp4():
    return spawn(4, 4, 1, _on_a_tp4_rank)


def test_every_rank_gets_the_rank_order_sum(tp4):
    assert all(r["ordered"] and r["grad_passes"] for r in tp4)
    assert all(torch.equal(r["summed"], tp4[0]["summed"]) for r in tp4)


def test_the_reduce_scatter_and_gather_sum_is_the_gathered_partials_sum_at_any_size(tp4):
    """`ordered_all_reduce` moves a ring all-reduce's bytes (each rank sums its share, then the shares are gathered),
    yet its every element is the one `ordered_sum` of all the gathered partials gives (vLLM's way), over 4 and over 3
    ranks, for sizes that do not split evenly, one element and none."""
    for r in tp4:
        assert all(r["shapes"].values()), r["shapes"]


def test_the_actor_at_tp4_sums_its_row_parallel_outputs_in_rank_order(tp4):
    """The same model with megatron's all-reduce: within BF16 rounding of the sums (logprobs of ~-6), not its bits."""
    for r in tp4:
        torch.testing.assert_close(r["logprobs"][True], r["logprobs"][False], atol=0.05, rtol=0)
        assert torch.equal(r["logprobs"][True], tp4[0]["logprobs"][True])
    assert "cannot sum in rank order" in tp4[0]["refused"] and "RowParallelLinear" in tp4[0]["refused"]


class _Communicator:
    def __init__(self, parts):
        self.parts = parts

    def all_gather(self, input_, dim):
        assert dim == 0
        return torch.cat(list(self.parts))


class _Coordinator:
    def __init__(self, parts):
        self.world_size = parts.shape[0]
        self.device_communicator = _Communicator(parts)

    def _all_reduce_out_place(self, input_):
        return self.device_communicator.parts.sum(0)  # vLLM's own: some other order


def test_the_vllm_patch_sums_above_two_ranks_in_rank_order(monkeypatch):
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.GroupCoordinator = _Coordinator
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = parallel_state
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)
    patch = load_patch("vllm_0_26_0_ordered_all_reduce")
    sampling = load_patch("vllm_0_26_0_seeded_sampling")
    monkeypatch.setattr(sampling, "installed_version", lambda: "0.27.0")
    with pytest.raises(sampling.VllmVersionError, match="targets vllm==0.26.0"):
        patch.apply()
    monkeypatch.setattr(sampling, "installed_version", lambda: "0.26.0")
    original = _Coordinator._all_reduce_out_place
    try:
        assert not patch.applied() and patch.apply() and patch.applied() and patch.apply()
        g = torch.Generator().manual_seed(0)
        for world in (2, 4, 8):
            parts = (torch.randn(world, 6, 32, generator=g) * 100).to(torch.bfloat16)
            got = _Coordinator(parts)._all_reduce_out_place(parts[0])
            want = ordered_sum(parts) if world > 2 else parts.sum(0)
            assert torch.equal(got, want), world
        patch.revert()
        assert not patch.applied() and _Coordinator._all_reduce_out_place is original
    finally:
        _Coordinator._all_reduce_out_place = original
