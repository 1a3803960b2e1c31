"""One GRPO step's experience as tensors: sampled sequences, which positions are response tokens, the
rollout engine's logprobs of them, rewards and group-normalized advantages.

Layout: `tokens[B, S]` right-padded (prompt then response; B = prompts x n, prompt-major), and every
per-token tensor is `[B, S-1]` aligned with the actor's logprobs, where column t is log p(tokens[t+1]):
a response token at sequence position j sits in column j-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from megatron_jetrl.rollout.engine import RequestOutput


@dataclass
class RolloutBatch:
    tokens: torch.Tensor
    """`[B, S]` int64, right-padded with the tokenizer's pad id."""
    mask: torch.Tensor
    """`[B, S-1]` float32: 1 where column t predicts a response token."""
    rollout_logprobs: torch.Tensor
    """`[B, S-1]` float32: the engine's logprob of that response token (0 elsewhere)."""
    rewards: torch.Tensor
    """`[B]` float32."""
    advantages: torch.Tensor
    """`[B]` float32."""
    response_lengths: torch.Tensor
    """`[B]` int64 (EOS included when the response stopped on it)."""
    truncated: torch.Tensor
    """`[B]` bool: stopped at max_new_tokens."""

    def rows(self, start: int, end: int) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name)[start:end] for f in fields(self)})

    def to(self, device) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def __len__(self) -> int:
        return self.tokens.shape[0]


def check_outputs(outputs: list[RequestOutput], n: int, vocab_size: int) -> None:
    """Refuse engine output the trainer cannot learn from, naming the prompt and completion: not `n` completions
    for a prompt (GRPO groups them per prompt), a completion without tokens or without a logprob per token, a
    token id outside `[0, vocab_size)`, a logprob that is NaN/Inf or positive."""
    for i, out in enumerate(outputs):
        if len(out.completions) != n:
            raise ValueError(
                f"the rollout engine returned {len(out.completions)} completions for prompt {i}, rollout.n={n} "
                "are needed (GRPO normalizes rewards per group of n): the engine is broken or ignores SamplingParams.n"
            )
        for j, c in enumerate(out.completions):
            where = f"completion {j} of prompt {i}"
            if len(c.logprobs) != len(c.token_ids) or not c.token_ids:
                raise ValueError(
                    f"the rollout engine returned a malformed completion ({len(c.token_ids)} tokens, "
                    f"{len(c.logprobs)} logprobs) as {where}: every sampled token needs its logprob"
                )
            bad = next((t for t in c.token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"the rollout engine returned token id {bad} in {where}, outside the vocabulary [0, {vocab_size}): "
                    "the engine serves another model or tokenizer than the trainer"
                )
            bad = next((lp for lp in c.logprobs if not (math.isfinite(lp) and lp <= 0)), None)
            if bad is not None:
                raise ValueError(
                    f"the rollout engine returned logprob {bad} in {where}; a logprob is finite and <= 0: "
                    "the engine is broken (NaN/Inf in its forward or sampling, or it returns something else)"
                )


def assemble(
    prompts: list[list[int]],
    outputs: list[RequestOutput],
    rewards: list[float],
    advantages: torch.Tensor,
    pad_id: int,
    width: int | None = None,
) -> RolloutBatch:
    """Tensors from the engine's outputs (one RequestOutput per prompt, n completions each; `check_outputs` first),
    `width` tokens wide (default: the longest prompt + response; a data-parallel rank's share passes the step's)."""
    seqs, lps, lengths, cut = [], [], [], []
    for prompt, out in zip(prompts, outputs, strict=True):
        for c in out.completions:
            seqs.append((prompt, c.token_ids))
            lps.append(c.logprobs)
            lengths.append(len(c.token_ids))
            cut.append(c.finish_reason == "length")
    if len(seqs) != len(rewards):
        raise ValueError(f"{len(seqs)} completions but {len(rewards)} rewards")
    longest = max(len(p) + len(r) for p, r in seqs)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width={width} is shorter than the longest sequence ({longest} tokens)")
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    rollout = torch.zeros(len(seqs), width - 1)
    for i, ((prompt, response), lp) in enumerate(zip(seqs, lps)):
        p, r = len(prompt), len(response)
        tokens[i, : p + r] = torch.tensor(prompt + response)
        mask[i, p - 1 : p - 1 + r] = 1.0
        rollout[i, p - 1 : p - 1 + r] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(
        tokens,
        mask,
        rollout,
        torch.tensor(rewards, dtype=torch.float32),
        advantages.float(),
        torch.tensor(lengths),
        torch.tensor(cut),
    )


@dataclass
class StepOutcome:
    """What every rank knows of the whole step's completions (prompt-major rows, as in `RolloutBatch`)."""

    rewards: torch.Tensor
    """`[B]` float32."""
    response_lengths: torch.Tensor
    """`[B]` int64."""
    truncated: torch.Tensor
    """`[B]` bool."""

    @classmethod
    def of(cls, outputs: list[RequestOutput], rewards: torch.Tensor) -> StepOutcome:
        done = [c for o in outputs for c in o.completions]
        if len(done) != len(rewards):
            raise ValueError(f"{len(done)} completions but {len(rewards)} rewards")
        return cls(
            rewards.float(),
            torch.tensor([len(c.token_ids) for c in done]),
            torch.tensor([c.finish_reason == "length" for c in done]),
        )


def response_aligned(*tensors: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """`[B, S-1]` per-token tensors, the last of them the response mask -> `[B, width]` float32 on the CPU with each
    row's response tokens moved to its start (column j: the response's token j); the mask comes back the same way."""
    *values, mask = (t.detach().float().cpu() for t in tensors)
    keep = mask.bool()
    lengths = keep.sum(1)
    if len(lengths) and int(lengths.max()) > width:
        raise ValueError(f"a response of {int(lengths.max())} tokens does not fit width={width}")
    rows = torch.repeat_interleave(torch.arange(len(mask)), lengths)
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    out = []
    for v in (*values, mask):
        aligned = torch.zeros(len(mask), width)
        aligned[rows, cols] = v[keep]
        out.append(aligned)
    return tuple(out)
