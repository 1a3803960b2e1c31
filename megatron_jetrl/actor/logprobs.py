"""Per-token log-probabilities of given token sequences from megatron's vocab-parallel logits.

The output layer is vocab-parallel: TP rank r holds logits of vocabulary rows [r*V/tp, (r+1)*V/tp) of the
*padded* vocabulary (`models.mapping.padded_vocab_size`). Padding rows are masked to -inf (they are not
tokens; HF's softmax has no such columns), then megatron's `vocab_parallel_cross_entropy` reduces the
max and sum-exp across TP ranks: log p(target) = -CE. Always FP32.

A model built with `ActorOptions(batch_invariant=True)` takes the engine's log-softmax instead
(`models.batch_invariant_ops`: FP64 exp/log, pairwise `tree_sum`; the TP partial sums are all-reduced).
"""

from __future__ import annotations

import torch

from megatron_jetrl.models import batch_invariant_ops as ops


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """`logits[..., V/tp]` (this TP rank's vocab shard), `targets[...]` -> FP32 log p(targets) `[...]`, differentiable."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float() / temperature  # a new tensor: megatron's cross entropy works in place
    part = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    if start + part > vocab_size:
        logits[..., max(vocab_size - start, 0):] = float("-inf")
    return -vocab_parallel_cross_entropy(logits, targets)


def batch_invariant_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """`vocab_parallel_logprobs` with `models.batch_invariant_ops.log_softmax`'s arithmetic (at TP1 its exact bits), differentiable."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = logits.float() / temperature
    part = x.shape[-1]
    rank = ps.get_tensor_model_parallel_rank()
    start = rank * part
    if start + part > vocab_size:
        x = x.clone()
        x[..., max(vocab_size - start, 0):] = float("-inf")
    top = x.detach().amax(dim=-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = x - top
    total = reduce_from_tensor_model_parallel_region(ops.tree_sum(ops.exp32(shifted)))
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = torch.where(mine, shifted.gather(-1, local.clamp(0, part - 1)[..., None])[..., 0], 0.0)
    return reduce_from_tensor_model_parallel_region(picked) - ops.log32(total)


def shifted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                     batch_invariant: bool = False) -> torch.Tensor:
    """GPTModel output `[b, s, V/tp]` for `tokens[b, s]` -> log p(tokens[:, t+1] | tokens[:, :t+1]), `[b, s-1]`."""
    fn = batch_invariant_logprobs if batch_invariant else vocab_parallel_logprobs
    return fn(logits[:, :-1], tokens[:, 1:], vocab_size, temperature)


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


def _batch_invariant(model) -> bool:
    """Whether the GPTModel (under any wrappers) was built with `ActorOptions(batch_invariant=True)`."""
    while hasattr(model, "module"):
        model = model.module
    options = getattr(model, "actor_options", None)
    return options is not None and options.batch_invariant


def forward_step_func(vocab_size: int, temperature: float, loss_fn=None):
    """A megatron `forward_step_func`: the loss callback gets `(logprobs[b, s-1], extras)`.

    Without `loss_fn` (forward only) the logprobs themselves are collected.
    """

    def forward_step(data_iterator, model):
        tokens, extras = next(data_iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, positions, None)
        batch_invariant = _batch_invariant(model)

        def loss_func(logits):
            logprobs = shifted_logprobs(logits, tokens, vocab_size, temperature, batch_invariant)
            if loss_fn is None:
                return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}
            loss, metrics = loss_fn(logprobs, extras)
            # copies: megatron divides the returned loss in place by the number of micro-batches
            return loss, {k: torch.as_tensor(v).detach().float().clone() for k, v in {"loss": loss, **metrics}.items()}

        return output, loss_func

    return forward_step


@torch.no_grad()
def compute_logprobs(model, tokens: torch.Tensor, *, vocab_size: int, micro_batch_size: int, temperature: float = 1.0):
    """log p(tokens[:, 1:]) `[B, S-1]` FP32 on the last pipeline stage (None on other stages).

    `tokens[B, S]` must be the same on every TP/PP rank of this DP replica; `model` the GPTModel (or its DDP
    wrapper) of this stage. Runs megatron's pipeline schedule, forward only.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = micro_batches(tokens, None, micro_batch_size)
    model.eval()
    out = get_forward_backward_func()(
        forward_step_func=forward_step_func(vocab_size, temperature), data_iterator=iter(micro), model=model,
        num_microbatches=len(micro), seq_length=tokens.shape[1], micro_batch_size=micro_batch_size, forward_only=True,
    )
    if not ps.is_pipeline_last_stage():
        return None
    return torch.cat([o["logprobs"] for o in out])
