"""`actor.layer_graphs` on the CPU: what decides whether a call replays graphs, and that a model built with them on
runs megatron's eager layers where they cannot run (the CPU), bit for bit. The graphs themselves run in
tests/gpu/test_layer_graphs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from actor_helpers import CONFIGS
from gloo import one_gloo_rank

from megatron_jetrl.fp8 import PrecisionFlow


@pytest.fixture(scope="module")
def one_rank():
    yield from one_gloo_rank()


def _model(graphs: bool, mode: str = "jetrl"):
    from megatron_jetrl.actor.hf_import import init_hf_weights
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.models import ModelArch

    arch = ModelArch.from_hf_config(CONFIGS["qwen3"])
    model = build_model(arch, PrecisionFlow(mode=mode), ActorOptions(logprob_graphs=graphs, update_graphs=graphs))
    init_hf_weights(model, arch, 0)
    return model


def test_the_signature_holds_shapes_and_values_and_refuses_what_it_cannot_hash():
    from megatron_jetrl.actor.layer_graphs import _signature

    x = torch.zeros(4, 2, 8)
    a = _signature((x,), {"attention_mask": None, "packed_seq_params": None})
    assert a == _signature((torch.ones(4, 2, 8),), {"packed_seq_params": None, "attention_mask": None})
    assert a != _signature((torch.zeros(5, 2, 8),), {"attention_mask": None, "packed_seq_params": None})
    strided = torch.zeros(2, 4, 8).transpose(0, 1)  # the same shape, another stride
    assert a != _signature((strided,), {"attention_mask": None, "packed_seq_params": None})
    assert a != _signature((x.requires_grad_(),), {"attention_mask": None, "packed_seq_params": None})
    assert _signature((x,), {"rotary": [1, 2]}) is None  # a list: no capture, the call runs eagerly


def test_the_batch_invariant_path_and_te_layers_refuse_graphs():
    from megatron_jetrl.actor.provider import ActorOptions

    with pytest.raises(ValueError, match="logprob_graphs / update_graphs need spec='local' without batch_invariant"):
        ActorOptions(batch_invariant=True, update_graphs=True)
    with pytest.raises(ValueError, match="need spec='local'"):
        ActorOptions(spec="te", logprob_graphs=True)


def test_on_the_cpu_a_model_with_graphs_runs_its_layers_eagerly_bit_for_bit(one_rank):
    from megatron_jetrl.actor.layer_graphs import GraphedTransformerLayer, graphed_layers, layer_graphs
    from megatron_jetrl.actor.logprobs import compute_logprobs

    on, off = _model(True), _model(False)
    assert len(graphed_layers(on)) == CONFIGS["qwen3"]["num_hidden_layers"]
    assert all(type(m) is GraphedTransformerLayer for m in graphed_layers(on))
    with layer_graphs(on, 8, train=False) as graphs:
        assert graphs is None  # no CUDA: nothing to capture
    tokens = torch.randint(0, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    got = compute_logprobs(on, tokens, vocab_size=300, micro_batch_size=2)
    assert torch.equal(got, compute_logprobs(off, tokens, vocab_size=300, micro_batch_size=2))
    assert dataclasses.replace(on.actor_options, logprob_graphs=False, update_graphs=False) == off.actor_options


def test_on_the_cpu_a_train_step_with_update_graphs_is_the_eager_step(one_rank):
    from megatron_jetrl.actor.optim_config import OptimConfig
    from megatron_jetrl.actor.train_step import train_step, wrap_for_training

    tokens = torch.randint(0, 300, (6, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for graphs in (True, False):
        ddp, optimizer = wrap_for_training(_model(graphs), OptimConfig(lr=1e-3, bf16=False))
        out = train_step(ddp, optimizer, tokens, lambda lp, ex: (-lp.mean(), {}), vocab_size=300, micro_batch_size=2)
        results.append((out, [p.detach().clone() for p in ddp.module.parameters()]))
    (a, wa), (b, wb) = results
    assert a == b and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
