"""The supervised warm-start before GRPO (`warmup` section): a model that never answers gets no GRPO signal, so the
tiny default first learns the generated task's format (arithmetic or multiplication trace) on `warmup.steps` SFT steps at `warmup.lr`."""

from __future__ import annotations

import torch

from megatron_jetrl.actor.parallel import from_last_stage
from megatron_jetrl.actor.train_step import train_step
from megatron_jetrl.rl import session as sess
from megatron_jetrl.rl.config import ConfigError
from megatron_jetrl.rl.metrics import progress


def sft_warm_start(s) -> None:
    """Supervised warm-start on the synthetic task (a model that never answers gets no GRPO signal), never on a
    held-out question (data.heldout)."""
    w = s.cfg.warmup
    if w.steps == 0:
        return
    from megatron.core import parallel_state as ps

    pairs = sess.generated_task(s.cfg).sft_pairs(
        w.steps * w.batch_size, seed=s.cfg.run.seed + 1, exclude=sess.questions(s.heldout)
    )
    tok = s.tokenizer
    seqs = [(tok.encode(question), tok.encode(answer) + [tok.eos_id]) for question, answer in pairs]
    longest = max(len(q) + len(a) for q, a in seqs)
    if longest > s.arch.max_position_embeddings:  # before any step: positions the model never had
        raise ConfigError(
            f"the warm-start's longest example is {longest} tokens, more than the model's "
            f"max_position_embeddings={s.arch.max_position_embeddings}: raise model.hf_config's "
            "max_position_embeddings, or shorten the task's examples (data.operand_max, data.multiplier_max)"
        )
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    groups = s.optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = w.lr
    bar = progress(w.steps, "warm-start (SFT)", enabled=s.is_main)
    for i in range(w.steps):
        chunk = seqs[i * w.batch_size : (i + 1) * w.batch_size]
        per_rank = w.batch_size // dp
        tokens, mask = sft_tensors(chunk[rank * per_rank : (rank + 1) * per_rank], tok.pad_id)
        tokens, mask = tokens.to(s.device), mask.to(s.device)  # the actor is on the GPU in a CUDA run
        out = train_step(
            s.model,
            s.optimizer,
            tokens,
            sft_loss,
            vocab_size=s.arch.vocab_size,
            micro_batch_size=min(per_rank, s.cfg.grpo.micro_batch_size),
            extras={"mask": mask},
            on_nonfinite="raise",
        )
        bar.update(1, loss=f"{from_last_stage(out).get('loss', float('nan')):.3f}")
    bar.close()
    for g, lr in zip(groups, lrs):
        g["lr"] = lr


def sft_tensors(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) + len(a) for p, a in pairs)
    tokens = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), width - 1)
    for i, (p, a) in enumerate(pairs):
        tokens[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
    return tokens, mask


def sft_loss(logprobs: torch.Tensor, extras: dict):
    mask = extras["mask"]
    return -(logprobs * mask).sum() / mask.sum(), {}
