"""The actor's decoder layers as CUDA graphs (`model.cuda_graphs`; `ActorOptions.logprob_graphs`, `.update_graphs`).

Why: megatron's local layer issues each of its few dozen kernels from Python, forward and backward. Where a layer's
GPU work is shorter than that host work (a TP rank's narrow GEMMs, short micro-batches, the FP8 linears' quantizer
launches) the GPU waits on the host. A CUDA graph replays a layer's launches with one host call.

Two kinds, each living for one call of the trainer (`layer_graphs`):
* a forward-only logprob pass (`actor.logprobs.compute_logprobs`, the old and the reference logprobs): `PassGraphs`;
* a train step's forwards and backwards (`actor.train_step.train_step`, any pipeline stage): `StepGraphs`.
Micro-batch 0 runs eagerly: it compiles and tunes the kernels, quantizes the FP8 weights of the current version and
makes DGrad's W^T bytes. At micro-batch 1 each layer is captured and replayed; the rest replay (a pipeline stage's
step captures a slot for each further micro-batch it holds at once). Nothing outlives the
call: no graph holds a weight version the next optimizer step replaces, and the graphs' memory goes back to the
allocator at its end. A call of fewer than `MIN_MICRO_BATCHES` micro-batches runs eagerly.

Bytes: a replay launches the kernels its capture recorded, on the same weights, with the inputs copied into the
buffers the capture read, so its outputs and gradients equal the eager ones bit for bit (tests/gpu/test_layer_graphs.py).

Memory: the layers of a call share one pool (a step under pipeline parallelism: one per slot, below), captured and
replayed in the same order on one stream.
* A pass keeps two hidden-state buffers: each layer reads one and writes the other, so a layer's input is the previous
  layer's output with no copy; the pass holds two activations of the micro-batch and one layer's working set.
* A step keeps each layer's output and what its backward reads: the eager step's activations of one micro-batch.
  Under pipeline parallelism a stage holds several micro-batches between their forward and their backward (1F1B: up
  to the pipeline's size on the first stage), so each layer has a slot per micro-batch in flight, captured when the
  schedule first needs it: a forward replays a free slot, which stays taken until its backward replays. Slot k of
  every layer shares pool k, apart from the other slots': within a slot the replays run in the order of their
  captures' lifetimes (the layers forward, then backward in reverse), so a block one capture freed and a later one
  reused is never live in both; across slots the micro-batches interleave and would not. Every layer of a stage sees
  the same forwards and backwards in the same order, so a micro-batch takes the same slot in all of them. Before its
  first capture a step gives the allocator's cached blocks back to the device (`torch.cuda.empty_cache`, one sync a
  step), so that the pools do not come on top of what micro-batch 0 left cached.
The last layer's output leaves a pass as a copy: what leaves the decoder (to the final norm, or to the next pipeline
stage) must not change under the next micro-batch's replay. A step's leaves as its slot's buffer, which no replay
writes before that micro-batch's backward (by then the next stage has received it).

Gradients of a step: a layer's backward graph adds its parameters' gradients into megatron DDP's FP32 `main_grad`
inside the graph, as eager does -- the linears whose WGrad accumulates there themselves (`grad_added_to_main_grad`),
the others (norms, biases) by the add that DDP's backward hook would do. Its gradient reduction runs after the last
micro-batch (`overlap_grad_reduce` is off), so no hook needs to fire.

Non-finite checks (`precision.check_finite: step`): each graph reduces the scales of its quantizations to one device
scalar inside the graph (`FiniteWatch.summary`); a replay hands a copy of it to the step's watch, which then names
the layer and direction (`decoder.layers.3 (CUDA graph, forward)`) instead of the linear.

What runs eagerly instead: a call in the other grad mode (the update's forwards under a pass's graphs, a no-grad
forward under a step's); a non-tensor argument that is not hashable; a call whose shapes or arguments differ from
those the layer was captured with (a call's micro-batches all have one shape); a step's forward while every slot is
in flight.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_jetrl.fp8 import finite

MIN_MICRO_BATCHES = 3
"""A call of fewer micro-batches runs eagerly: one warms the kernels, one captures, and only the rest gain. A step that
may capture several slots needs one more micro-batch per further slot (`layer_graphs`)."""


class GraphedTransformerLayer(TransformerLayer):
    """megatron's `TransformerLayer`; inside a `layer_graphs` block its calls replay CUDA graphs."""

    graphs: _Graphs | None = None
    """The open call's graphs (set by `layer_graphs` for its duration), else None: megatron's forward."""

    def forward(self, *args, **kwargs):
        if self.graphs is not None:
            return self.graphs.forward(self, args, kwargs)
        return super().forward(*args, **kwargs)

    def eager_forward(self, *args, **kwargs):
        return TransformerLayer.forward(self, *args, **kwargs)


@functools.cache
def _stream(device: int) -> torch.cuda.Stream:
    """The stream every graphed call on `device` runs on, eager micro-batch included (`layer_graphs`): a capture needs
    a stream other than the legacy default one, and the eager micro-batch makes the lazy per-stream state (cuBLAS
    workspaces, the autograd engine's) that a capture must not. One for the process, so that the blocks the caching
    allocator keeps for it serve every call."""
    return torch.cuda.Stream(device=device)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream):
    """The block's CUDA work on `stream`, after what the caller's stream has queued, and the caller's stream after it."""
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


def _signature(args: tuple, kwargs: dict):
    """What a capture holds fixed: each tensor's shape, stride, dtype, device and whether it requires grad, every other
    argument's value; None where an argument is neither a tensor nor hashable."""
    parts = []
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad))
            continue
        try:
            hash(value)
        except TypeError:
            return None
        parts.append((name, value))
    return tuple(parts)


@dataclass(eq=False)  # compared by identity: a slot is one capture
class _Captured:
    signature: tuple
    inputs: dict
    """Argument position or name -> the tensor the capture read."""
    forward: torch.cuda.CUDAGraph
    output: torch.Tensor
    """The hidden states the forward graph writes."""
    forward_finite: torch.Tensor | None = None
    backward: torch.cuda.CUDAGraph | None = None
    grad_output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None
    backward_finite: torch.Tensor | None = None
    site: str = ""
    aliased: frozenset = frozenset()
    """The inputs that are another capture's output buffer (the previous layer's, same slot): a replay reads them in
    place, so it runs only where the call passes that very buffer."""
    in_flight: bool = False
    """A step's slot between its forward replay and its backward replay: its buffers hold that micro-batch."""


class _Graphs:
    """What both kinds share: which layers are warm, the captures, the pool and the capture stream."""

    train = False

    def __init__(self, layers: list[GraphedTransformerLayer], sites: dict[int, str]):
        self.layers = layers
        self.sites = sites
        """id(layer) -> its module name (`decoder.layers.3`), which non-finite reports give."""
        self.warm: set[int] = set()
        self.captured: dict[int, list[_Captured]] = {}
        """id(layer) -> its captures: one for a pass, a slot each for a step's micro-batches in flight."""
        self.pools: list = []
        self.stream = _stream(torch.cuda.current_device())
        self.replays = 0
        self.eager_calls = 0

    def forward(self, layer: GraphedTransformerLayer, args: tuple, kwargs: dict):
        signature = _signature(args, kwargs) if torch.is_grad_enabled() == self.train else None
        key = id(layer)
        entry = None
        if signature is not None and key in self.warm:
            entry = self._entry(layer, args, kwargs, signature)
        if entry is not None and any(_argument(args, kwargs, n).data_ptr() != entry.inputs[n].data_ptr() for n in entry.aliased):
            entry = None  # its input is not the buffer the capture reads in place
        if entry is None:
            self.warm.add(key)
            self.eager_calls += 1
            return layer.eager_forward(*args, **kwargs)
        with torch.no_grad():  # a static input may be a leaf that requires grad
            for name, static in entry.inputs.items():
                if name not in entry.aliased:
                    static.copy_(_argument(args, kwargs, name))
        self.replays += 1
        return self._replay(layer, entry, _hidden(args, kwargs)), None

    def _pool(self, slot: int):
        """The memory pool of slot `slot`'s captures (`StepGraphs`; a pass has one)."""
        while len(self.pools) <= slot:
            self.pools.append(torch.cuda.graph_pool_handle())
        return self.pools[slot]

    def _static_inputs(self, args: tuple, kwargs: dict, known: list[torch.Tensor]):
        """The capture's own copies of the tensor arguments, or the buffer of `known` a tensor already is (read in place
        at replay: `_Captured.aliased`); returns (inputs, aliased names, static args, static kwargs)."""
        inputs, aliased = {}, set()

        def static(name, value):
            if not isinstance(value, torch.Tensor):
                return value
            same = next((b for b in known if b.data_ptr() == value.data_ptr() and b.shape == value.shape), None)
            if same is not None:
                aliased.add(name)
            held = same.detach() if same is not None else value.detach().clone()
            inputs[name] = held.requires_grad_(value.requires_grad)
            return inputs[name]

        static_args = tuple(static(i, a) for i, a in enumerate(args))
        static_kwargs = {k: static(k, v) for k, v in kwargs.items()}
        return inputs, frozenset(aliased), static_args, static_kwargs

    @contextlib.contextmanager
    def _capturing(self, graph: torch.cuda.CUDAGraph, slot: int = 0):
        """Capture `graph` into slot `slot`'s pool on the call's stream; yields the watch its quantizations record into."""
        with finite.watch() as watch:
            graph.capture_begin(pool=self._pool(slot), capture_error_mode="thread_local")
            try:
                yield watch
            except BaseException as e:  # what broke the capture, not capture_end's "invalidated" that follows it
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise RuntimeError(f"capturing a decoder layer as a CUDA graph failed (set model.cuda_graphs=none): {e}") from e
            graph.capture_end()


def _argument(args: tuple, kwargs: dict, name):
    return args[name] if isinstance(name, int) else kwargs[name]


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    """A layer call's hidden states (megatron's block passes them by keyword)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _only_hidden(out, layer) -> torch.Tensor:
    hidden, context = out
    if context is not None:
        raise RuntimeError(f"{type(layer).__name__} returned a context tensor: run it with model.cuda_graphs=none")
    return hidden


class PassGraphs(_Graphs):
    """The forward graphs of one forward-only pass over a pipeline stage's decoder layers."""

    def __init__(self, layers, sites):
        super().__init__(layers, sites)
        self.buffers: list[torch.Tensor] = []

    def _entry(self, layer, args, kwargs, signature) -> _Captured | None:
        """The layer's one capture (made at its first call after the eager one), None where it has another signature."""
        captured = self.captured.setdefault(id(layer), [])
        if not captured:
            captured.append(self._capture(layer, args, kwargs, signature))
        return captured[0] if captured[0].signature == signature else None

    def _capture(self, layer, args, kwargs, signature) -> _Captured:
        inputs, aliased, static_args, static_kwargs = self._static_inputs(args, kwargs, self.buffers)
        hidden_in = _hidden(static_args, static_kwargs)
        if not self.buffers:
            self.buffers = [torch.empty_like(hidden_in, memory_format=torch.contiguous_format) for _ in range(2)]
        output = self.buffers[1] if hidden_in.data_ptr() == self.buffers[0].data_ptr() else self.buffers[0]
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph):
            output.copy_(_only_hidden(layer.eager_forward(*static_args, **static_kwargs), layer))
        return _Captured(signature, inputs, graph, output, aliased=aliased)

    def _replay(self, layer, entry: _Captured, hidden: torch.Tensor) -> torch.Tensor:
        entry.forward.replay()
        return entry.output.clone() if layer is self.layers[-1] else entry.output


class StepGraphs(_Graphs):
    """The forward and backward graphs of one train step over a stage's decoder layers: a slot per micro-batch the
    stage holds at once, at most `slots`."""

    train = True

    def __init__(self, layers, sites, slots: int):
        super().__init__(layers, sites)
        if slots < 1:
            raise ValueError(f"a step's layer graphs need at least one slot, got slots={slots}")
        self.slots = slots

    def _entry(self, layer, args, kwargs, signature) -> _Captured | None:
        """A free slot of the layer (the lowest), captured now if all its slots are in flight and fewer than `slots`
        exist; None where every slot is in flight or the layer was captured with another signature."""
        captured = self.captured.setdefault(id(layer), [])
        if captured and captured[0].signature != signature:
            return None
        free = next((c for c in captured if not c.in_flight), None)
        if free is None and len(captured) < self.slots:
            free = self._capture(layer, args, kwargs, signature, slot=len(captured))
            captured.append(free)
        return free

    def _capture(self, layer, args, kwargs, signature, slot: int) -> _Captured:
        if not any(self.captured.values()):
            torch.cuda.empty_cache()  # micro-batch 0's cached blocks back to the device before the pools take their own
        outputs = [c.output for c in self.captured.get(id(self._previous(layer)), [])[slot : slot + 1]]
        inputs, aliased, static_args, static_kwargs = self._static_inputs(args, kwargs, outputs)
        hidden_in = _hidden(static_args, static_kwargs)
        params = [p for p in layer.parameters() if p.requires_grad]
        missing = [n for n, p in layer.named_parameters() if p.requires_grad and getattr(p, "main_grad", None) is None]
        if missing:
            raise RuntimeError(
                f"update graphs add gradients into megatron DDP's main_grad, which {missing[:3]} lack: wrap the model "
                "with actor.train_step.wrap_for_training, or set model.cuda_graphs=logprobs"
            )
        site = self.sites.get(id(layer), "a decoder layer")
        entry = _Captured(signature, inputs, torch.cuda.CUDAGraph(), None, site=site, aliased=aliased)
        with self._capturing(entry.forward, slot) as watch:
            entry.output = _only_hidden(layer.eager_forward(*static_args, **static_kwargs), layer)
            entry.forward_finite = watch.summary()
        entry.grad_output = torch.empty_like(entry.output)
        entry.backward = torch.cuda.CUDAGraph()
        for p in params:
            p.grad_added_to_main_grad = False
        with self._capturing(entry.backward, slot) as watch:
            grads = torch.autograd.grad(
                entry.output, [hidden_in, *params], entry.grad_output, retain_graph=True, allow_unused=True
            )
            entry.grad_input = grads[0]
            for p, g in zip(params, grads[1:], strict=True):
                if g is not None and not p.grad_added_to_main_grad:  # else WGrad accumulated into main_grad itself
                    p.main_grad.add_(g)
            entry.backward_finite = watch.summary()
        for p in params:
            p.grad_added_to_main_grad = False
        return entry

    def _previous(self, layer):
        """The layer before `layer` in this stage, or None: its output buffer, in the same slot, is `layer`'s input."""
        index = next(i for i, m in enumerate(self.layers) if m is layer)
        return self.layers[index - 1] if index else None

    def _replay(self, layer, entry: _Captured, hidden: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(entry, hidden)


class _Replay(torch.autograd.Function):
    """One layer's forward graph in the autograd graph of the step; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, entry: _Captured, hidden: torch.Tensor):  # `hidden`: the edge autograd follows back (already copied)
        ctx.entry = entry
        entry.in_flight = True
        entry.forward.replay()
        if entry.forward_finite is not None:
            finite.record(f"{entry.site} (CUDA graph, forward)", entry.forward_finite.clone())
        return entry.output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        entry = ctx.entry
        if grad.data_ptr() != entry.grad_output.data_ptr():
            entry.grad_output.copy_(grad)
        entry.backward.replay()
        entry.in_flight = False
        if entry.backward_finite is not None:
            finite.record(f"{entry.site} (CUDA graph, backward)", entry.backward_finite.clone())
        return None, None if entry.grad_input is None else entry.grad_input.detach()


@contextlib.contextmanager
def autograd_stream(model):
    """Where `model` replays update graphs (`ActorOptions.update_graphs`, CUDA): the block runs on the graphs' stream.
    Wrap megatron DDP's construction in it: DDP makes each parameter's gradient accumulator, and autograd keeps the
    stream current then as the stream that accumulator's gradients arrive on; a backward captured on the graphs'
    stream must not make another stream wait on it."""
    from megatron_jetrl.actor.gpt import unwrap

    options = getattr(unwrap(model), "actor_options", None)
    param = next(model.parameters(), None)
    if not (getattr(options, "update_graphs", False) and param is not None and param.is_cuda):
        yield
        return
    with _on_stream(_stream(param.device.index)):
        yield


def graphed_layers(model) -> list[GraphedTransformerLayer]:
    """The decoder layers of this pipeline stage of `model` (under any wrappers) that can replay graphs."""
    from megatron_jetrl.actor.gpt import unwrap

    decoder = getattr(unwrap(model), "decoder", None)
    return [m for m in getattr(decoder, "layers", []) if isinstance(m, GraphedTransformerLayer)]


@contextlib.contextmanager
def layer_graphs(model, micro_batches: int, *, train: bool, in_flight: int | None = None):
    """Inside the block, `model`'s decoder layers replay CUDA graphs captured in it: the forward-only passes' where
    `ActorOptions.logprob_graphs` (`train=False`), a train step's forwards and backwards where
    `ActorOptions.update_graphs` (`train=True`); on CUDA, for at least `MIN_MICRO_BATCHES` micro-batches. A step
    captures a slot for each micro-batch the stage holds at once, up to `in_flight` (default: the pipeline's size, what
    megatron's 1F1B schedule holds on the first stage; a stage that holds more runs the excess eagerly), and needs
    `in_flight - 1` micro-batches more (fewer would capture and never replay). Yields the
    graphs, or None where the call runs eagerly. Inside an open block a nested one of the same kind yields the open
    one's graphs: calls over the same weights and shapes replay what the first captured (a caller that changes the
    weights between them must close the block first)."""
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.gpt import unwrap

    options = getattr(unwrap(model), "actor_options", None)
    layers = graphed_layers(model)
    if layers and isinstance(layers[0].graphs, StepGraphs if train else PassGraphs):
        yield layers[0].graphs
        return
    wanted = getattr(options, "update_graphs" if train else "logprob_graphs", False)
    on_cuda = bool(layers) and next(layers[0].parameters()).is_cuda
    slots = (in_flight or ps.get_pipeline_model_parallel_world_size()) if train and wanted and on_cuda else 1
    if not (wanted and on_cuda and micro_batches >= MIN_MICRO_BATCHES + slots - 1):
        yield None
        return
    sites = {id(m): name for name, m in unwrap(model).named_modules() if isinstance(m, GraphedTransformerLayer)}
    graphs = StepGraphs(layers, sites, slots) if train else PassGraphs(layers, sites)
    before = [layer.graphs for layer in layers]
    for layer in layers:
        layer.graphs = graphs
    try:
        with _on_stream(graphs.stream):  # the whole call: micro-batch 0 warms this stream's state too
            yield graphs
    finally:
        for layer, old in zip(layers, before, strict=True):
            layer.graphs = old
