"""The logprob passes' CUDA graphs (`actor.forward_graphs`, `model.cuda_graphs: logprobs`) on one GPU.

A pass that replays graphs returns the eager pass's logprobs bit for bit, in BF16 and in the FP8 flow, at two model
shapes (Qwen2-style and Qwen3-style with q/k norms); every layer is captured once and replayed for every later
micro-batch; a weight change between passes is seen by the next pass (its graphs are captured anew); the update
(grad enabled) never replays.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_helpers import ARCH

pytestmark = pytest.mark.gpu

QWEN3 = dict(ARCH, model_type="qwen3", num_hidden_layers=4)  # q/k norms; 4 layers: the two buffers alternate
SHAPES = {"qwen2": ARCH, "qwen3": QWEN3}


@pytest.fixture(scope="module")
def ready(parallel):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return True


def _model(config: dict, mode: str, graphs: bool = True):
    from megatron_jetrl.actor.hf_import import init_hf_weights
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models import ModelArch

    arch = ModelArch.from_hf_config(config)
    options = ActorOptions(params_dtype=torch.bfloat16, logprob_graphs=graphs)
    model = build_model(arch, PrecisionFlow(mode=mode, backend="auto"), options)
    init_hf_weights(model, arch, 0)
    return model


def _eager(model):
    """The same model with its logprob passes eager."""
    model.actor_options = dataclasses.replace(model.actor_options, logprob_graphs=False)
    return model


def _logprobs(model, tokens, micro=2, first=None):
    from megatron_jetrl.actor.logprobs import compute_logprobs

    return compute_logprobs(model, tokens, vocab_size=ARCH["vocab_size"], micro_batch_size=micro, first=first)


def _tokens(batch, seq, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, ARCH["vocab_size"], (batch, seq), device="cuda", generator=g)


@pytest.mark.parametrize("mode", ["bf16", "jetrl"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_pass_that_replays_graphs_returns_the_eager_passs_logprobs_bit_for_bit(ready, shape, mode):
    from megatron_jetrl.actor.forward_graphs import graphed_layers, pass_graphs

    model = _model(SHAPES[shape], mode)
    tokens = _tokens(12, 256)
    first = torch.tensor([40, 3, 97, 128, 5, 5, 200, 1, 64, 64, 17, 250])  # logits from each micro-batch's smallest
    with pass_graphs(model, 6) as graphs:
        got = _logprobs(model, tokens, first=first)
    layers = len(graphed_layers(model))
    assert graphs is not None and len(graphs.captured) == layers
    assert (graphs.eager_calls, graphs.replays) == (layers, layers * 5)
    want = _logprobs(_eager(model), tokens, first=first)
    assert torch.equal(got, want)
    assert all(layer.graphs is None for layer in graphed_layers(model))


def test_the_next_pass_sees_new_weights_and_the_update_runs_eagerly(ready):
    from megatron_jetrl.actor.fp8_layers import requantize_weights
    from megatron_jetrl.actor.optim_config import OptimConfig
    from megatron_jetrl.actor.train_step import train_step, wrap_for_training

    model = _model(QWEN3, "jetrl")
    tokens = _tokens(8, 128, seed=1)
    before = _logprobs(model, tokens)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    requantize_weights(model)
    after = _logprobs(model, tokens)
    assert not torch.equal(before, after)
    assert torch.equal(after, _logprobs(_eager(model), tokens))
    model.actor_options = dataclasses.replace(model.actor_options, logprob_graphs=True)
    ddp, optimizer = wrap_for_training(model, OptimConfig(lr=1e-4))

    def loss_fn(logprobs, extras):
        return -logprobs.mean(), {}

    out = train_step(ddp, optimizer, tokens, loss_fn, vocab_size=ARCH["vocab_size"], micro_batch_size=2)
    assert out["ok"] and all(layer.graphs is None for layer in graphed_layers_of(ddp))
    assert torch.equal(_logprobs(ddp, tokens), _logprobs(_eager(model), tokens))


def graphed_layers_of(model):
    from megatron_jetrl.actor.forward_graphs import graphed_layers

    return graphed_layers(model)
