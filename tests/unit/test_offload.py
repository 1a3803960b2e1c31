"""`rollout.offload`: the actor's gradients, optimizer state and FP8 weight copies (the policy's dropped and made
again, the KL reference's copied out and back) freed while the engine is awake and brought back
(`actor.offload.TrainStateOffload`), on gloo ranks as the GRPO loop drives it. The CPU runs the same steps on host
tensors: storages emptied, bytes counted, and the training bit for bit the training without offload."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import actor_scenario as sc
import pytest
import torch
from actor_helpers import CONFIGS, hf_state, spawn, write_hf_checkpoint


@pytest.fixture(
    scope="module", params=[(1, False, True), (2, True, True), (1, False, False)], ids=["dp1", "dp2-zero1", "fp32-weights"]
)
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
            # the policy's FP8 copies (W, W^T, scales) dropped after each sync and made again with the same bytes
            assert run["fp8_freed"] == run["fp8_expected"] and all(n > 0 for n in run["fp8_freed"])
            # what the KV sizing counts from the shapes: all of them, and all still to be made once dropped
            assert run["fp8_counted"] == [(n, n) for n in run["fp8_expected"]]
            assert run["fp8_same"] == [True] * (sc.STEPS + 1)
            assert run["reference_same"] == [True] * (sc.STEPS + 1)  # the reference's bytes back from host memory
            assert [s["loss"] for s in run["steps"]] == [s["loss"] for s in plain["steps"]]
            assert [s["grad_norm"] for s in run["steps"]] == [s["grad_norm"] for s in plain["steps"]]
            assert run["params"].keys() == plain["params"].keys()
            assert all(torch.equal(run["params"][n], plain["params"][n]) for n in plain["params"])
            assert len(run["adam"]) == len(plain["adam"]) > 0
            for ours, theirs in zip(run["adam"], plain["adam"]):
                assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        # a KV cache sized at the engine's start leaves the actor what it will still hold while the engine is awake:
        # Adam's moments and the FP8 copies not made yet, less what the offload takes away then
        for what, holds in (
            ("none", lambda adam, policy, ref: adam + policy + ref),
            ("grads", lambda adam, policy, ref: adam + ref),
            ("optimizer", lambda adam, policy, ref: 0),
        ):
            counted, adam, policy, ref = rank[what]["to_come"]
            assert adam > 0 and policy > 0 and ref > 0 and counted == holds(adam, policy, ref)
        grads, ref = rank["grads"]["freed"], rank["optimizer"]["reference_fp8"]
        full = [n - ref for n in rank["optimizer"]["freed"]]  # less the reference's FP8 bytes, copied out at every release
        assert ref > 0
        assert grads[0] == grads[-1]  # the FP32 gradient buffers, the same every time
        if bf16:  # before the first step: + the FP32 main params (4 bytes a param); after it: + Adam's two moments (and step)
            assert full[0] - grads[0] > 0 and full[-1] - grads[-1] > 2.9 * (full[0] - grads[0])
        else:  # the FP32 weights stay: nothing of the optimizer's before the first step, then the moments
            assert full[0] == grads[0] and full[-1] - grads[-1] >= 2 * grads[0]


def test_offload_names_its_choices():
    from megatron_jetrl.actor.offload import TrainStateOffload

    with pytest.raises(ValueError, match=r"offload must be one of \('grads', 'optimizer'\), got 'none'"):
        TrainStateOffload(None, None, "none")


@pytest.fixture(scope="module")
def qwen3_checkpoint():
    with tempfile.TemporaryDirectory() as d:
        write_hf_checkpoint(Path(d) / "qwen3", CONFIGS["qwen3"], hf_state(CONFIGS["qwen3"]), sharded=False)
        yield d


def test_releasing_the_bf16_linear_weights_trains_bit_for_bit_and_survives_a_skip_and_an_error(qwen3_checkpoint):
    """`model.bf16_linear_weights=release` (jetrl's default where megatron's mixed-precision optimizer runs): while the
    loss runs, every FP8 linear's BF16 weight storage is empty (freed: as many bytes as those weights hold); three
    steps give the losses, grad norms, weights and Adam state of `keep` bit for bit; a step skipped for a NaN loss and a
    step whose loss callback raises leave the weights as they were; a NaN weight is named by the step's finiteness check
    (the release quantizes inside it)."""
    (runs,) = spawn(1, 1, 1, sc.bf16_release_round_trips, qwen3_checkpoint)
    keep, release = runs["keep"], runs["release"]
    assert all(release["released_in_loss"]) and len(release["released_in_loss"]) == 2 * (sc.STEPS + 2) + 1
    for run in (keep, release):  # a NaN weight is found by the step's one finiteness check, wherever it is quantized
        assert re.search(r"the FP8 quantizer input decoder\.layers\.0\.\S+: weight \(NaN", run["nan_weight"]), run["nan_weight"]
    assert not any(keep["released_in_loss"]) and release["bf16_bytes"] > 0
    assert [s["loss"] for s in release["steps"]] == [s["loss"] for s in keep["steps"]]
    assert [s["grad_norm"] for s in release["steps"]] == [s["grad_norm"] for s in keep["steps"]]
    for run in (keep, release):
        assert run["skipped_ok"] is False and run["same_after_skip"] and run["same_after_raise"]
        assert run["raised"] == "the loss callback failed"
    assert all(torch.equal(release["params"][n], p) for n, p in keep["params"].items())
    assert len(release["adam"]) == len(keep["adam"]) > 0
    for ours, theirs in zip(release["adam"], keep["adam"]):
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_releasing_the_bf16_linear_weights_under_the_distributed_optimizer_is_refused(qwen3_checkpoint):
    (message,) = spawn(1, 1, 1, sc.bf16_release_refused_under_the_distributed_optimizer, qwen3_checkpoint)
    assert message.endswith(
        "its BF16 weight is a view into a larger buffer (megatron's distributed optimizer keeps the "
        "parameters in one): it cannot be freed alone; set model.bf16_linear_weights=keep, or "
        "optim.distributed=false"
    )


def test_the_config_releases_where_it_applies_and_refuses_where_it_cannot():
    from megatron_jetrl.rl.config import ConfigError, load_config

    tiny = [str(Path(__file__).resolve().parents[2] / "configs/tiny.yaml")]
    assert load_config(tiny, []).bf16_linears_released()  # jetrl, local spec, mixed-precision optimizer
    for off in (["precision.mode=bf16"], ["optim.distributed=true"], ["optim.bf16=false"], ["model.bf16_linear_weights=keep"]):
        assert not load_config(tiny, off).bf16_linears_released(), off
    with pytest.raises(
        ConfigError,
        match=r"model.bf16_linear_weights=release needs megatron's mixed-precision optimizer "
        r"\(optim.bf16=true, optim.distributed=false\)",
    ):
        load_config(tiny, ["model.bf16_linear_weights=release", "optim.distributed=true"])
    with pytest.raises(ConfigError, match=r"mode 'bf16' with model.spec=local trains none: set it to auto or keep"):
        load_config(tiny, ["model.bf16_linear_weights=release", "precision.mode=bf16"])
    with pytest.raises(ConfigError, match=r"model.bf16_linear_weights must be 'auto', 'keep' or 'release', got 'sometimes'"):
        load_config(tiny, ["model.bf16_linear_weights=sometimes"])
