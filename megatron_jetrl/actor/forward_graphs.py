"""The logprob passes' decoder layers as CUDA graphs (`model.cuda_graphs: logprobs`, `ActorOptions.logprob_graphs`).

Why: a logprob pass (the old and the reference logprobs of a step) runs every decoder layer once per micro-batch,
forward only, and megatron's local layer issues each of its few dozen kernels from Python. Where a layer's GPU work is
shorter than its host work (a TP rank's narrow GEMMs, short micro-batches, FP8 linears' quantizer launches) the GPU
waits on the host. A CUDA graph replays a layer's launches with one host call.

Lifetime: the graphs of a pass live for that pass (`pass_graphs`, opened by `actor.logprobs.compute_logprobs` for a
pass of at least `MIN_MICRO_BATCHES`). Micro-batch 0 runs eagerly: it compiles and tunes the kernels and quantizes the
FP8 weights of the current version. At micro-batch 1 each layer is captured and replayed; the rest replay. Nothing
outlives the pass: no graph holds a weight version the next optimizer step replaces, and the graphs' memory goes back
to the allocator when the pass ends.

Bytes: a replay launches the kernels its capture recorded, on the same weights, with the inputs copied into the
buffers the capture read, so its output equals the eager forward's bit for bit (tests/gpu/test_forward_graphs.py).

Buffers: the layers of a pass share one memory pool (captured and replayed in the same order, one at a time, on one
stream) and two hidden-state buffers: each captured layer reads one and writes the other, so a layer's input is the
previous layer's output with no copy, and the memory a pass holds is two activations of the micro-batch plus one
layer's working set. The stage's last layer returns a copy: what leaves the decoder (to the final norm, or to the
next pipeline stage) must not change under the next micro-batch's replay.

What runs eagerly instead: a call with grad enabled (the update); a non-tensor argument that is not hashable; a call
whose shapes or arguments differ from those the layer was captured with (another micro-batch shape, which a pass
does not have).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

MIN_MICRO_BATCHES = 3
"""A pass of fewer micro-batches runs eagerly: one warms the kernels, one captures, and only the rest gain."""


class GraphedTransformerLayer(TransformerLayer):
    """megatron's `TransformerLayer`; inside a `pass_graphs` block its forward-only calls replay a CUDA graph."""

    graphs: LayerGraphs | None = None
    """The open pass's graphs (set by `pass_graphs` for its duration), else None: megatron's forward."""

    def forward(self, *args, **kwargs):
        if self.graphs is not None and not torch.is_grad_enabled():
            return self.graphs.forward(self, args, kwargs)
        return super().forward(*args, **kwargs)

    def eager_forward(self, *args, **kwargs):
        return TransformerLayer.forward(self, *args, **kwargs)


def _signature(args: tuple, kwargs: dict):
    """What a capture holds fixed: each tensor's shape, stride, dtype and device, every other argument's value;
    None where an argument is neither a tensor nor hashable."""
    parts = []
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            parts.append((name, "tensor", tuple(value.shape), value.stride(), value.dtype, value.device))
            continue
        try:
            hash(value)
        except TypeError:
            return None
        parts.append((name, value))
    return tuple(parts)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    signature: tuple
    inputs: dict
    """Argument position or name -> the tensor the capture read."""
    output: torch.Tensor
    """The hidden-state buffer the graph writes."""


class LayerGraphs:
    """The CUDA graphs of one forward-only pass over a pipeline stage's decoder layers (see the module docstring)."""

    def __init__(self, layers: list[GraphedTransformerLayer]):
        self.layers = layers
        self.warm: set[int] = set()
        self.captured: dict[int, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.buffers: list[torch.Tensor] = []
        self.replays = 0
        self.eager_calls = 0

    def forward(self, layer: GraphedTransformerLayer, args: tuple, kwargs: dict):
        signature = _signature(args, kwargs)
        key = id(layer)
        entry = self.captured.get(key)
        if signature is None or key not in self.warm or (entry is not None and entry.signature != signature):
            self.warm.add(key)
            self.eager_calls += 1
            return layer.eager_forward(*args, **kwargs)
        if entry is None:
            entry = self.captured[key] = self._capture(layer, args, kwargs, signature)
        for name, static in entry.inputs.items():
            given = args[name] if isinstance(name, int) else kwargs[name]
            if given.data_ptr() != static.data_ptr():
                static.copy_(given)
        entry.graph.replay()
        self.replays += 1
        hidden = entry.output.clone() if layer is self.layers[-1] else entry.output
        return hidden, None

    def _buffer(self, like: torch.Tensor, avoid: torch.Tensor | None) -> torch.Tensor:
        """One of the two hidden-state buffers, not `avoid` (the layer's input)."""
        if not self.buffers:
            self.buffers = [torch.empty_like(like, memory_format=torch.contiguous_format) for _ in range(2)]
        return self.buffers[1] if avoid is self.buffers[0] else self.buffers[0]

    def _capture(self, layer, args: tuple, kwargs: dict, signature: tuple) -> _Captured:
        inputs = {}

        def static(name, value):
            if not isinstance(value, torch.Tensor):
                return value
            known = next((b for b in self.buffers if b.data_ptr() == value.data_ptr() and b.shape == value.shape), None)
            inputs[name] = known if known is not None else value.clone()
            return inputs[name]

        static_args = tuple(static(i, a) for i, a in enumerate(args))
        static_kwargs = {k: static(k, v) for k, v in kwargs.items()}
        hidden_in = static_kwargs.get("hidden_states", static_args[0] if static_args else None)
        output = self._buffer(hidden_in, hidden_in)
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                hidden, context = layer.eager_forward(*static_args, **static_kwargs)
                if context is not None:
                    raise RuntimeError(f"{type(layer).__name__} returned a context tensor: run it with model.cuda_graphs=none")
                output.copy_(hidden)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return _Captured(graph, signature, inputs, output)


def graphed_layers(model) -> list[GraphedTransformerLayer]:
    """The decoder layers of this pipeline stage of `model` (under any wrappers) that can replay a graph."""
    from megatron_jetrl.actor.gpt import unwrap

    decoder = getattr(unwrap(model), "decoder", None)
    return [m for m in getattr(decoder, "layers", []) if isinstance(m, GraphedTransformerLayer)]


@contextlib.contextmanager
def pass_graphs(model, micro_batches: int):
    """Inside the block, the forward-only calls of `model`'s decoder layers replay CUDA graphs captured in it
    (`ActorOptions.logprob_graphs`, CUDA, at least `MIN_MICRO_BATCHES` micro-batches); yields the `LayerGraphs`, or
    None where the pass runs eagerly. Inside an open block a nested one yields the open one's graphs: passes over the
    same weights and shapes replay what the first captured (a caller that changes the weights between them must
    close the block first)."""
    from megatron_jetrl.actor.gpt import unwrap

    options = getattr(unwrap(model), "actor_options", None)
    layers = graphed_layers(model)
    if layers and layers[0].graphs is not None:  # an enclosing block's graphs serve the passes inside it
        yield layers[0].graphs
        return
    on_cuda = bool(layers) and next(layers[0].parameters()).is_cuda
    if not (getattr(options, "logprob_graphs", False) and on_cuda and micro_batches >= MIN_MICRO_BATCHES):
        yield None
        return
    graphs = LayerGraphs(layers)
    for layer in layers:
        layer.graphs = graphs
    try:
        yield graphs
    finally:
        for layer in layers:
            layer.graphs = None
