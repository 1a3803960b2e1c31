"""Per-sequence sampling with temperature, top-p and a `torch.Generator` per sequence.

Each sequence owns its generator, so its tokens depend on its seed and its own logits only (not on the
batch it shares). Top-p follows vLLM: sort ascending, drop the tokens whose cumulative probability is
`<= 1 - top_p`, always keep the most likely one. Sampling is `argmax(p / E)` with `E ~ Exp(1)` drawn from
the sequence's generator (vLLM's exponential race; equivalent to a categorical draw from `p`).
"""

from __future__ import annotations

import torch


def step_seed(run_seed: int, step: int) -> int:
    """`SamplingParams.seed` of a GRPO step: its prompts get request seeds `step_seed + prompt index`
    (`rollout.engine.request_seeds_for`), so steps stay 1_000_003 prompts apart and no prompt of one step shares a
    request seed (hence noise) with a prompt of another."""
    return (int(run_seed) * 1_000_003 + step) * 1_000_003


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request, in both engines: consecutive request seeds (the pool's
    `seed + prompt index`) stay 1_000_003 samples apart. vLLM, which seeds sample j with `seed + j` itself, gets
    `sample_seed(request_seed, 0)` (`rollout.vllm_engine.sampling_kwargs`)."""
    return (int(request_seed) * 1_000_003 + sample_index) % (2**63 - 1)


def sequence_generator(request_seed: int | None, sample_index: int, device="cpu") -> torch.Generator:
    """The generator of sample `sample_index` of a request: seeded with `sample_seed`, or fresh entropy."""
    g = torch.Generator(device=device)
    if request_seed is None:
        g.seed()
    else:
        g.manual_seed(sample_seed(request_seed, sample_index))
    return g


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the nucleus and renormalize, per row of `probs` `[..., V]` (FP32)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=False, stable=True)
    cumulative = sorted_p.cumsum(-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1] = False  # the most likely token always stays
    kept = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
    filtered = torch.zeros_like(probs).scatter(-1, order, kept)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `logits` `[B, V]` (row r races with `generators[r]`): long `[B]` on logits' device.

    Row-wise ops only, so a row's token does not depend on the other rows; the host sync is the caller's.
    """
    if len(generators) != logits.shape[0]:
        raise ValueError(f"{len(generators)} generators for {logits.shape[0]} rows of logits")
    if temperature < 1e-5:
        return logits.float().argmax(-1)
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)
    race = torch.empty_like(probs)
    for row, g in zip(race, generators):
        row.exponential_(generator=g)
    return (probs / race).argmax(-1)
