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


def _one_f_one_b(stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """megatron's 1F1B order on a pipeline's first stage: warm-up forwards, then one forward and one backward in turn,
    then the cool-down backwards."""
    warmup = min(stages - 1, micro_batches)
    order = [("F", k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(micro_batches - warmup, micro_batches)]


class _Layer:
    def eager_forward(self, hidden):
        return hidden + 1, None


def _fake_step_graphs(monkeypatch, layers, slots):
    """`StepGraphs` whose captures and replays are bookkeeping only (no CUDA): what it captures, replays or runs
    eagerly, and which slot each micro-batch takes in each layer."""
    from megatron_jetrl.actor import layer_graphs as lg

    monkeypatch.setattr(lg, "_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Fake(lg.StepGraphs):
        def _capture(self, layer, args, kwargs, signature, slot):
            self.log.append(("capture", self.layers.index(layer), slot))
            inputs, aliased, static_args, _ = self._static_inputs(args, kwargs, [])
            return lg._Captured(signature, inputs, None, static_args[0] + 1, aliased=aliased)

        def _replay(self, layer, entry, hidden):
            entry.in_flight = True
            slot = self.captured[id(layer)].index(entry)
            self.log.append(("replay", self.layers.index(layer), slot))
            self.taken.append(entry)
            return entry.output

    graphs = Fake(layers, {}, slots)
    graphs.log, graphs.taken = [], []
    return graphs


@pytest.mark.parametrize(
    "stages,slots,captured,eager",
    [(1, 1, 1, [0]), (3, 3, 3, [0]), (4, 4, 4, [0]), (4, 2, 2, [0, 3, 4])],
    ids=["pp1", "pp3", "pp4", "pp4-two-slots"],
)
def test_a_step_takes_a_slot_per_micro_batch_in_flight_the_same_in_every_layer(monkeypatch, stages, slots, captured, eager):
    """Under 1F1B the first stage holds up to `stages` micro-batches between forward and backward: micro-batch 0 runs
    eagerly, each later one replays a free slot (the lowest, the same in every layer, whose pool it then owns),
    captured on first need; a forward while all `slots` are in flight runs eagerly; a backward frees its slot."""
    layers = [_Layer() for _ in range(3)]
    graphs = _fake_step_graphs(monkeypatch, layers, slots)
    held: dict[int, list] = {}
    eager_micro_batches = []
    x = torch.zeros(2, 1, 4, requires_grad=True)
    for op, k in _one_f_one_b(stages, micro_batches=7):
        if op == "B":
            for entry in reversed(held.pop(k)):
                entry.in_flight = False
            continue
        start, eager_before = len(graphs.taken), graphs.eager_calls
        for layer in layers:
            graphs.forward(layer, (x,), {})
        held[k] = graphs.taken[start:]
        if graphs.eager_calls > eager_before:
            eager_micro_batches.append(k)
            assert (graphs.eager_calls - eager_before, held[k]) == (len(layers), []), "all eager or all replayed"
        else:
            slots_taken = {graphs.captured[id(layer)].index(e) for layer, e in zip(layers, held[k], strict=True)}
            assert len(slots_taken) == 1, f"micro-batch {k} took slots {slots_taken} across the layers"
    assert eager_micro_batches == eager
    assert [len(graphs.captured[id(layer)]) for layer in layers] == [captured] * len(layers)
    assert graphs.replays == len(layers) * (7 - len(eager))


def test_a_step_replays_a_layer_only_on_the_buffer_its_capture_reads_in_place(monkeypatch):
    """A layer whose capture read the previous layer's output buffer in place (same slot) replays only when given that
    buffer; given any other tensor it runs eagerly rather than overwrite a buffer another micro-batch may hold."""
    from megatron_jetrl.actor.layer_graphs import _Captured, _signature

    graphs = _fake_step_graphs(monkeypatch, [_Layer()], 2)
    buffer = torch.zeros(2, 1, 4)
    x = torch.zeros(2, 1, 4)
    inputs, aliased, _, _ = graphs._static_inputs((buffer,), {}, [buffer])
    assert aliased == {0} and inputs[0].data_ptr() == buffer.data_ptr()
    graphs.captured[id(graphs.layers[0])] = [_Captured(_signature((x,), {}), inputs, None, x, aliased=aliased)]
    graphs.warm.add(id(graphs.layers[0]))
    graphs.forward(graphs.layers[0], (buffer,), {})
    assert (graphs.replays, graphs.eager_calls) == (1, 0)
    graphs.taken[-1].in_flight = False
    graphs.forward(graphs.layers[0], (x,), {})
    assert (graphs.replays, graphs.eager_calls) == (1, 1)


@pytest.mark.parametrize("in_flight,micro_batches,graphed", [(1, 3, True), (1, 2, False), (4, 6, True), (4, 5, False)])
def test_a_step_runs_eagerly_when_its_slots_would_leave_nothing_to_replay(monkeypatch, in_flight, micro_batches, graphed):
    """One micro-batch warms the kernels and each slot captures one: a step opens graphs only where at least one more
    micro-batch is left to replay them (`MIN_MICRO_BATCHES` at one slot)."""
    import contextlib
    import types

    from megatron_jetrl.actor import layer_graphs as lg

    layer = types.SimpleNamespace(graphs=None, parameters=lambda: iter([types.SimpleNamespace(is_cuda=True)]))
    model = torch.nn.Module()
    model.actor_options = types.SimpleNamespace(update_graphs=True)
    monkeypatch.setattr(lg, "graphed_layers", lambda m: [layer])
    monkeypatch.setattr(lg, "_stream", lambda device: None)
    monkeypatch.setattr(lg, "_on_stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with lg.layer_graphs(model, micro_batches, train=True, in_flight=in_flight) as graphs:
        assert (graphs is not None) == graphed
        assert graphs is None or graphs.slots == in_flight
    assert layer.graphs is None
