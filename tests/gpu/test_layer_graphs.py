"""The actor's decoder layers as CUDA graphs (`actor.layer_graphs`, `model.cuda_graphs`) on one GPU.

A logprob pass that replays graphs returns the eager pass's logprobs bit for bit, and a train step that replays them
the eager step's loss, gradients and new weights bit for bit: BF16 and the FP8 flow, a Qwen2-style shape (q/k/v
biases, whose gradients DDP's hook would add) and a Qwen3-style one (q/k norms), BF16 linear weights kept and released.
Every layer is captured once per call and replayed for every later micro-batch; a weight change between passes is
seen by the next pass; a NaN that reaches a graphed layer's quantizer is reported with the layer and direction.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_helpers import ARCH

pytestmark = pytest.mark.gpu

QWEN3 = dict(ARCH, model_type="qwen3", num_hidden_layers=4)  # q/k norms; 4 layers: a pass's two buffers alternate
SHAPES = {"qwen2": dict(ARCH, num_hidden_layers=3), "qwen3": QWEN3}
VOCAB = ARCH["vocab_size"]


@pytest.fixture(scope="module")
def ready(parallel):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return True


def _model(config: dict, mode: str, **options):
    from megatron_jetrl.actor.hf_import import init_hf_weights
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models import ModelArch

    arch = ModelArch.from_hf_config(config)
    options = ActorOptions(params_dtype=torch.bfloat16, logprob_graphs=True, update_graphs=True, **options)
    model = build_model(arch, PrecisionFlow(mode=mode, backend="auto"), options)
    init_hf_weights(model, arch, 0)
    return model


def _graphs(model, on: bool):
    from megatron_jetrl.actor.gpt import unwrap

    inner = unwrap(model)
    inner.actor_options = dataclasses.replace(inner.actor_options, logprob_graphs=on, update_graphs=on)
    return model


def _logprobs(model, tokens, micro=2, first=None):
    from megatron_jetrl.actor.logprobs import compute_logprobs

    return compute_logprobs(model, tokens, vocab_size=VOCAB, micro_batch_size=micro, first=first)


def _tokens(batch, seq, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=g)


def _step(ddp, optimizer, tokens, on_nonfinite="raise"):
    from megatron_jetrl.actor.train_step import train_step

    def loss_fn(logprobs, extras):
        return -(logprobs * extras["w"][:, 1:]).mean(), {}

    w = torch.linspace(0.5, 1.5, tokens.numel(), device="cuda").view_as(tokens)
    return train_step(
        ddp, optimizer, tokens, loss_fn, vocab_size=VOCAB, micro_batch_size=2, extras={"w": w}, on_nonfinite=on_nonfinite
    )


@pytest.mark.parametrize("mode", ["bf16", "jetrl"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_pass_that_replays_graphs_returns_the_eager_passs_logprobs_bit_for_bit(ready, shape, mode):
    from megatron_jetrl.actor.layer_graphs import graphed_layers, layer_graphs

    model = _model(SHAPES[shape], mode)
    tokens = _tokens(12, 256)
    first = torch.tensor([40, 3, 97, 128, 5, 5, 200, 1, 64, 64, 17, 250])  # logits from each micro-batch's smallest
    with layer_graphs(model, 6, train=False) as graphs:
        got = _logprobs(model, tokens, first=first)
    layers = len(graphed_layers(model))
    assert graphs is not None and len(graphs.captured) == layers
    assert (graphs.eager_calls, graphs.replays) == (layers, layers * 5)
    assert torch.equal(got, _logprobs(_graphs(model, False), tokens, first=first))
    assert all(layer.graphs is None for layer in graphed_layers(model))


def test_the_next_pass_sees_new_weights(ready):
    from megatron_jetrl.actor.fp8_layers import requantize_weights

    model = _model(QWEN3, "jetrl")
    tokens = _tokens(8, 128, seed=1)
    before = _logprobs(model, tokens)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    requantize_weights(model)
    after = _logprobs(model, tokens)
    assert not torch.equal(before, after)
    assert torch.equal(after, _logprobs(_graphs(model, False), tokens))


@pytest.mark.parametrize(
    "mode,release", [("bf16", "keep"), ("jetrl", "keep"), ("jetrl", "release")], ids=["bf16", "jetrl", "jetrl-release"]
)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_step_that_replays_graphs_is_the_eager_step_bit_for_bit(ready, shape, mode, release):
    from megatron_jetrl.actor.layer_graphs import graphed_layers, layer_graphs
    from megatron_jetrl.actor.optim_config import OptimConfig
    from megatron_jetrl.actor.train_step import wrap_for_training

    runs = []
    for on in (True, False):
        model = _model(SHAPES[shape], mode, bf16_linear_weights=release)
        ddp, optimizer = wrap_for_training(_graphs(model, on), OptimConfig(lr=1e-3))
        tokens = _tokens(10, 256, seed=2)
        results = []
        for step in range(2):
            with layer_graphs(ddp, 5, train=True) as graphs:
                results.append(_step(ddp, optimizer, tokens))
            layers = len(graphed_layers(ddp))
            if on:
                assert graphs is not None and (graphs.eager_calls, graphs.replays) == (layers, layers * 4), step
            else:
                assert graphs is None
        grads = [p.main_grad.clone() for p in ddp.module.parameters() if getattr(p, "main_grad", None) is not None]
        weights = [p.detach().clone() for p in ddp.module.parameters()]
        runs.append((results, grads, weights, _logprobs(ddp, tokens)))
        del ddp, optimizer, model
    (got, got_grads, got_weights, got_lp), (want, want_grads, want_weights, want_lp) = runs
    assert got == want  # loss, metrics and grad norm of both steps, as floats
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_weights, want_weights, strict=True))
    assert torch.equal(got_lp, want_lp)


def test_a_nan_inside_a_graphed_layer_names_the_layer_and_direction(ready):
    from megatron_jetrl.actor.optim_config import OptimConfig
    from megatron_jetrl.actor.train_step import wrap_for_training

    model = _model(QWEN3, "jetrl")
    ddp, optimizer = wrap_for_training(model, OptimConfig(lr=1e-3))
    tokens = _tokens(10, 256, seed=3) % (VOCAB - 1)
    tokens[6, 100] = VOCAB - 1  # a token only micro-batch 3 holds (replayed), whose embedding is NaN
    with torch.no_grad():
        model.embedding.word_embeddings.weight[VOCAB - 1] = float("nan")
    out = _step(ddp, optimizer, tokens, on_nonfinite="skip")
    assert not out["ok"] and "quantizer input decoder.layers.0 (CUDA graph, forward) (NaN" in out["skipped"], out


# megatron's 1F1B order on the first of 3 pipeline stages: up to 3 micro-batches between their forward and backward
ONE_F_ONE_B = "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6".split()


@pytest.mark.parametrize("mode", ["bf16", "jetrl"])
def test_a_step_with_micro_batches_in_flight_is_the_eager_step_bit_for_bit(ready, mode):
    """A pipeline stage's step (here the first stage's 1F1B order at PP 3 on one GPU, without the sends): each micro-batch
    in flight replays its own slot of every layer, captured when first needed (three), and the losses and every
    `main_grad` equal the eager ones bit for bit."""
    from megatron_jetrl.actor.layer_graphs import graphed_layers, layer_graphs
    from megatron_jetrl.actor.optim_config import OptimConfig
    from megatron_jetrl.actor.train_step import wrap_for_training

    tokens = _tokens(14, 256, seed=4).view(7, 2, 256)
    positions = torch.arange(256, device="cuda").expand(2, 256)
    runs = []
    for on in (True, False):
        ddp, _ = wrap_for_training(_graphs(_model(QWEN3, mode), on), OptimConfig(lr=1e-3))
        ddp.zero_grad_buffer()
        losses, pending = [], {}
        with layer_graphs(ddp, 7, train=True, in_flight=3) as graphs:
            for op in ONE_F_ONE_B:
                k = int(op[1:])
                if op[0] == "F":
                    pending[k] = ddp(tokens[k], positions, None).float().logsumexp(-1).mean()
                    losses.append(pending[k].item())
                else:
                    pending.pop(k).backward()
        layers = graphed_layers(ddp)
        if on:
            assert graphs is not None and (graphs.eager_calls, graphs.replays) == (len(layers), 6 * len(layers))
            assert [len(graphs.captured[id(layer)]) for layer in layers] == [3] * len(layers)
        runs.append((losses, [p.main_grad.clone() for p in ddp.module.parameters() if p.requires_grad]))
        del ddp
    (got, got_grads), (want, want_grads) = runs
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
