"""`rollout.offload`: the actor's gradients and optimizer state freed while the engine is awake and brought back
(`actor.offload.TrainStateOffload`), on gloo ranks as the GRPO loop drives it. The CPU runs the same steps on host
tensors: storages emptied, bytes counted, and the training bit for bit the training without offload."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import actor_scenario as sc
from actor_helpers import CONFIGS, hf_state, spawn, write_hf_checkpoint


@pytest.fixture(scope="module", params=[(1, False, True), (2, True, True), (1, False, False)], ids=["dp1", "dp2-zero1", "fp32-weights"])
def runs(request):
    """Per rank, per setting (sc.offload_round_trips); the last case trains FP32 weights in place (optim.bf16=false)."""
    world, distributed, bf16 = request.param
    with tempfile.TemporaryDirectory() as d:
        write_hf_checkpoint(Path(d) / "qwen3", CONFIGS["qwen3"], hf_state(CONFIGS["qwen3"]), sharded=False)
        yield request.param, spawn(world, 1, 1, sc.offload_round_trips, d, distributed, bf16)


def test_offload_frees_what_it_says_and_trains_bit_for_bit(runs):
    """Every release empties the gradient buffers (and the optimizer's storages, not the weights), frees the bytes
    this rank holds there, and the steps, weights and Adam state equal the run without offload bit for bit."""
    (_, _, bf16), ranks = runs
    for rank in ranks:
        plain = rank["none"]
        for what in ("grads", "optimizer"):
            run = rank[what]
            assert run["empty"] == [True] * (sc.STEPS + 1)
            assert run["freed"] == run["expected"] and all(n > 0 for n in run["freed"])
            assert [s["loss"] for s in run["steps"]] == [s["loss"] for s in plain["steps"]]
            assert [s["grad_norm"] for s in run["steps"]] == [s["grad_norm"] for s in plain["steps"]]
            assert run["params"].keys() == plain["params"].keys()
            assert all(torch.equal(run["params"][n], plain["params"][n]) for n in plain["params"])
            assert len(run["adam"]) == len(plain["adam"]) > 0
            for ours, theirs in zip(run["adam"], plain["adam"]):
                assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        grads, full = rank["grads"]["freed"], rank["optimizer"]["freed"]
        assert grads[0] == grads[-1]  # the FP32 gradient buffers, the same every time
        if bf16:  # before the first step: + the FP32 main params (4 bytes a param); after it: + Adam's two moments (and step)
            assert full[0] - grads[0] > 0 and full[-1] - grads[-1] > 2.9 * (full[0] - grads[0])
        else:  # the FP32 weights stay: nothing of the optimizer's before the first step, then the moments
            assert full[0] == grads[0] and full[-1] - grads[-1] >= 2 * grads[0]


def test_offload_names_its_choices():
    from megatron_jetrl.actor.offload import TrainStateOffload

    with pytest.raises(ValueError, match=r"offload must be one of \('grads', 'optimizer'\), got 'none'"):
        TrainStateOffload(None, None, "none")
