"""Per-token log-probabilities of given token sequences from megatron's vocab-parallel logits.

The output layer is vocab-parallel: TP rank r holds logits of vocabulary rows [r*V/tp, (r+1)*V/tp) of the
*padded* vocabulary (`models.mapping.padded_vocab_size`). Padding rows are masked to -inf (they are not
tokens; HF's softmax has no such columns); the max and sum-exp are reduced across TP ranks: log p(target) =
(x_t - max) - log(sum exp(x - max)), x = logits / temperature, all in FP32.

Two implementations of that arithmetic:
- `vocab_parallel_logprobs`: megatron's `vocab_parallel_cross_entropy` on an FP32 copy of the logits. It keeps
  the FP32 softmax for backward and makes about a dozen passes over [tokens, V] FP32 tensors: at a 152K vocab
  and 4096 tokens, 2.5 GB each, some 50 GB of memory traffic per micro-batch.
- `fused_vocab_parallel_logprobs` (`ActorOptions.fused`, the default): the same ops, op for op, in three row
  functions that read the BF16 logits directly (max; sum-exp and the target's logit; the gradient), compiled by
  Inductor on CUDA into one kernel each. Backward saves the BF16 logits, not an FP32 softmax, and recomputes
  exp. Eagerly (CPU) it returns megatron's bits exactly; compiled, a sum may run in another order.

A model built with `ActorOptions(batch_invariant=True)` takes the native engine's log-softmax instead
(`models.batch_invariant_ops`: FP64 exp/log, pairwise `tree_sum`; the TP partial sums are all-reduced), and one built
with `ActorOptions(rollout_kernels=True)` vLLM's (`exact_logprobs`: vLLM's own kernel, imported lazily; the other
kernels of that option are in `actor.rollout_kernels`).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_jetrl.actor.fp8_layers import unwrap
from megatron_jetrl.actor.fused import on_cuda_compiled
from megatron_jetrl.actor.layer_graphs import layer_graphs
from megatron_jetrl.models import batch_invariant_ops as ops


def _shard(part: int, vocab_size: int) -> tuple[int, int]:
    """(first vocabulary row of this TP rank's `part` columns, how many of them are tokens, not padding)."""
    from megatron.core import parallel_state as ps

    start = ps.get_tensor_model_parallel_rank() * part
    return start, min(max(vocab_size - start, 0), part)


def _tp_all_reduce(t: torch.Tensor, op) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, op=op, group=ps.get_tensor_model_parallel_group())


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """`logits[..., V/tp]` (this TP rank's vocab shard), `targets[...]` -> FP32 log p(targets) `[...]`, differentiable."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float() / temperature  # a new tensor: megatron's cross entropy works in place
    _, valid = _shard(logits.shape[-1], vocab_size)
    logits[..., valid:] = float("-inf")
    return -vocab_parallel_cross_entropy(logits, targets)


def _scaled(logits: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    """FP32 `logits / temperature` with this shard's padding columns (index >= `valid`) at -inf."""
    x = logits.float() / temperature
    if valid < x.shape[-1]:
        x = torch.where(torch.arange(x.shape[-1], device=x.device) < valid, x, float("-inf"))
    return x


def _row_max(logits, valid: int, temperature: float):
    return _scaled(logits, valid, temperature).amax(dim=-1)


def _row_sums(logits, targets, top, start: int, valid: int, temperature: float):
    """(x_t - max where this shard holds the target, else 0; sum exp(x - max)) per row."""
    shifted = _scaled(logits, valid, temperature) - top.unsqueeze(-1)
    local = targets - start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mine, picked, 0.0), shifted.exp().sum(dim=-1)


def _grad_logits(logits, targets, top, total, grad, start: int, valid: int, temperature: float):
    """d logprob / d logits: (onehot(target) - softmax) * grad / temperature, in the logits' dtype (megatron's
    backward with grad_output = -grad, then the division's and the cast's backward)."""
    softmax = (_scaled(logits, valid, temperature) - top.unsqueeze(-1)).exp() / total.unsqueeze(-1)
    target = torch.arange(logits.shape[-1], device=logits.device) == (targets - start).unsqueeze(-1)
    d = torch.where(target, softmax - 1.0, softmax) * (-grad).unsqueeze(-1)
    return (d / temperature).to(logits.dtype)


_compiled_row_max, _compiled_row_sums, _compiled_grad_logits = map(on_cuda_compiled, (_row_max, _row_sums, _grad_logits))


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size: int, temperature: float):
        start, valid = _shard(logits.shape[-1], vocab_size)
        top = _compiled_row_max(logits, valid, temperature)
        _tp_all_reduce(top, torch.distributed.ReduceOp.MAX)
        predicted, total = _compiled_row_sums(logits, targets, top, start, valid, temperature)
        _tp_all_reduce(predicted, torch.distributed.ReduceOp.SUM)
        _tp_all_reduce(total, torch.distributed.ReduceOp.SUM)
        ctx.save_for_backward(logits, targets, top, total)
        ctx.shard = (start, valid, temperature)
        return predicted - torch.log(total)

    @staticmethod
    def backward(ctx, grad):
        logits, targets, top, total = ctx.saved_tensors
        return _compiled_grad_logits(logits, targets, top, total, grad, *ctx.shard), None, None, None


def fused_vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """`vocab_parallel_logprobs`'s arithmetic without its FP32 copies of the logits (module docstring), differentiable."""
    return _FusedLogprobs.apply(logits, targets, vocab_size, temperature)


def batch_invariant_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """`vocab_parallel_logprobs` with `models.batch_invariant_ops.log_softmax`'s arithmetic (at TP1 its exact bits), differentiable."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = logits.float() / temperature
    part = x.shape[-1]
    start, valid = _shard(part, vocab_size)
    if valid < part:
        x = x.clone()
        x[..., valid:] = float("-inf")
    top = x.detach().amax(dim=-1, keepdim=True)
    _tp_all_reduce(top, torch.distributed.ReduceOp.MAX)
    shifted = x - top
    total = reduce_from_tensor_model_parallel_region(ops.tree_sum(ops.exp32(shifted)))
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = torch.where(mine, shifted.gather(-1, local.clamp(0, part - 1)[..., None])[..., 0], 0.0)
    return reduce_from_tensor_model_parallel_region(picked) - ops.log32(total)


class _ExactLogprobs(torch.autograd.Function):
    """log p(target) over the first `vocab_size` columns of full-vocabulary BF16 logits `[N, V]`: forward vLLM's own
    kernel for a sampled token's raw logprob (`compute_token_logprobs`: max, then sum of exp, then x - max - log(sum),
    one program per row, on the BF16 logits as vLLM's sampler holds them), backward softmax - onehot from the row's
    log-sum-exp x_target - logprob, in the fused path's compiled gradient kernel."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size: int):
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        out = compute_token_logprobs(logits[:, :vocab_size], targets[:, None])[:, 0]
        lse = logits.gather(-1, targets[:, None])[:, 0].float() - out
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_size = vocab_size
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        return _compiled_grad_logits(logits, targets, lse, torch.ones_like(lse), grad, 0, ctx.vocab_size, 1.0), None, None


def exact_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """`logits[..., V/tp]` (this TP rank's vocabulary shard), `targets[...]` -> FP32 log p(targets), differentiable,
    with vLLM's arithmetic: the shards gathered (vLLM gathers its lm_head's output too), the padding columns dropped,
    then vLLM's sampled-token logprob kernel. vLLM reports logprobs at temperature 1 (`logprobs_mode=raw_logprobs`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if temperature != 1.0:
        raise ValueError(f"exact_logprobs computes vLLM's raw logprobs (temperature 1), got temperature={temperature}")
    split = ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1
    full = gather_from_tensor_model_parallel_region(logits) if split else logits
    if full.shape[-1] < vocab_size:
        raise ValueError(f"logits have {full.shape[-1]} vocabulary columns, fewer than vocab_size={vocab_size}")
    flat = full.reshape(-1, full.shape[-1])
    return _ExactLogprobs.apply(flat, targets.reshape(-1), vocab_size).view(targets.shape)


def shifted_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    batch_invariant: bool = False,
    fused: bool = False,
    rollout_kernels: bool = False,
) -> torch.Tensor:
    """GPTModel output `[b, s, V/tp]` for `tokens[b, s]` -> log p(tokens[:, t+1] | tokens[:, :t+1]), `[b, s-1]`.

    The fused path runs on all `s` rows (the last one's target is token 0 and its logprob is dropped): slicing the
    logits to `s-1` rows would make autograd copy the whole gradient into a zero-filled full-size buffer.
    `rollout_kernels`: the vLLM engine's log-softmax (`exact_logprobs`)."""
    if rollout_kernels:
        return exact_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, temperature)
    if batch_invariant:
        return batch_invariant_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, temperature)
    if fused:
        targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
        return fused_vocab_parallel_logprobs(logits, targets, vocab_size, temperature)[:, :-1]
    return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, temperature)


def micro_batches(tokens: torch.Tensor, extras: dict | None, micro_batch_size: int) -> list[tuple[torch.Tensor, dict]]:
    """Split `tokens[B, S]` and per-sample `extras` (tensors with leading dim B) into micro-batches."""
    batch = tokens.shape[0]
    if batch % micro_batch_size:
        raise ValueError(f"batch {batch} is not a multiple of micro_batch_size {micro_batch_size}")
    extras = extras or {}
    return [
        (tokens[i : i + micro_batch_size], {k: v[i : i + micro_batch_size] for k, v in extras.items()})
        for i in range(0, batch, micro_batch_size)
    ]


def pad_length(tokens: torch.Tensor, extras: dict | None, multiple: int) -> tuple[torch.Tensor, dict]:
    """`tokens[B, S]` and the per-token extras (`[B, S-1]`: masks, logprobs) lengthened on the right to a multiple of
    `multiple` (others as they are): the padding repeats each row's last token and is 0 in the extras, so a loss that
    weighs tokens by the response mask never sees it, and under causal attention no real token's logprob changes."""
    s = tokens.shape[1]
    pad = -s % multiple
    extras = extras or {}
    if pad == 0:
        return tokens, extras
    tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
    return tokens, {
        k: torch.nn.functional.pad(v, (0, pad)) if v.dim() == 2 and v.shape[1] == s - 1 else v for k, v in extras.items()
    }


def sequence_multiple(model) -> int:
    """The length every sequence needs for this model's forward: the TP size under sequence parallelism (megatron splits
    the sequence evenly over the TP ranks), else 1."""
    from megatron.core import parallel_state as ps

    config = getattr(unwrap(model), "config", None)
    return ps.get_tensor_model_parallel_world_size() if getattr(config, "sequence_parallel", False) else 1


def _actor_options(model):
    """The `ActorOptions` the GPTModel (under any wrappers) was built with, or None."""
    return getattr(unwrap(model), "actor_options", None)


def response_start(mask: torch.Tensor) -> torch.Tensor:
    """Each row's first response column of `mask[B, S-1]` (1 on response tokens) as a CPU int64 `[B]`; 0 for a row
    without one. Logprob column t is predicted at position t: positions before a row's start need no logits."""
    found = mask.bool()
    return torch.where(found.any(dim=1), found.int().argmax(dim=1), 0).cpu()


@contextlib.contextmanager
def logits_from(model, start: int):
    """Inside the block the GPTModel's output layer sees positions `start..` only (prompt positions need no logits:
    the lm_head GEMMs and the logprob passes shrink by that share); yields the first position it computes (0
    where it cannot: no output layer on this pipeline stage, or sequence-parallel hidden states)."""
    layer = getattr(unwrap(model), "output_layer", None)
    if start <= 0 or layer is None or getattr(layer, "sequence_parallel", False):
        yield 0
        return
    handle = layer.register_forward_pre_hook(lambda _, args, kwargs: ((args[0][start:], *args[1:]), kwargs), with_kwargs=True)
    try:
        yield start
    finally:
        handle.remove()


def _start(extras: dict) -> int:
    first = extras.get("first")
    if first is None or first.numel() == 0:
        return 0
    if first.device.type != "cpu":
        raise ValueError(
            f"extras['first'] must be a CPU tensor (it decides the logits' shape on the host, with no "
            f"sync), got one on {first.device}: pass response_start(mask)"
        )
    return int(first.min())


def forward_step_func(vocab_size: int, temperature: float, loss_fn=None):
    """A megatron `forward_step_func`: the loss callback gets `(logprobs[b, s-1], extras)`.

    Without `loss_fn` (forward only) the logprobs themselves are collected. With `extras["first"]` (CPU int64 per
    row, `response_start`) logits are computed from the micro-batch's smallest first response column on, and the
    logprobs before it are 0 (prompt positions, which the loss never reads).
    """

    def forward_step(data_iterator, model):
        tokens, extras = next(data_iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        with logits_from(model, _start(extras)) as start:
            output = model(tokens, positions, None)
        options = _actor_options(model)
        kinds = (options.batch_invariant, options.fused, options.rollout_kernels) if options is not None else (False,) * 3

        def loss_func(logits):
            logprobs = shifted_logprobs(logits, tokens[:, start:], vocab_size, temperature, *kinds)
            if start:
                logprobs = torch.nn.functional.pad(logprobs, (start, 0))
            if loss_fn is None:
                return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}
            loss, metrics = loss_fn(logprobs, extras)
            # copies: megatron divides the returned loss in place by the number of micro-batches
            return loss, {k: torch.as_tensor(v).detach().float().clone() for k, v in {"loss": loss, **metrics}.items()}

        return output, loss_func

    return forward_step


def run_schedule(model, micro: list, step_func, *, forward_only: bool) -> list:
    """megatron's pipeline schedule over the micro-batches `micro` (`micro_batches`' output, one shape), its decoder
    layers replaying CUDA graphs where the model was built for them (`actor.layer_graphs`: `ActorOptions.logprob_graphs`
    forward only, `.update_graphs` with a backward); the schedule's per-micro-batch outputs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = micro[0][0]
    with layer_graphs(model, len(micro), train=not forward_only):
        return get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=iter(micro),
            model=model,
            num_microbatches=len(micro),
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=forward_only,
        )


@torch.no_grad()
def compute_logprobs(
    model,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    micro_batch_size: int,
    temperature: float = 1.0,
    first: torch.Tensor | None = None,
):
    """log p(tokens[:, 1:]) `[B, S-1]` FP32 on the last pipeline stage (None on other stages).

    `tokens[B, S]` must be the same on every TP/PP rank of this DP replica; `model` the GPTModel (or its DDP
    wrapper) of this stage. Runs megatron's pipeline schedule, forward only. `first` (`response_start` of the
    response mask): each micro-batch skips the logits of positions before its first response column, whose
    logprobs come back 0.
    """
    from megatron.core import parallel_state as ps

    length = tokens.shape[1]
    tokens, _ = pad_length(tokens, None, sequence_multiple(model))  # the padding's logprobs are dropped below
    micro = micro_batches(tokens, None if first is None else {"first": first}, micro_batch_size)
    model.eval()
    out = run_schedule(model, micro, forward_step_func(vocab_size, temperature), forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return torch.cat([o["logprobs"] for o in out])[:, : length - 1]
