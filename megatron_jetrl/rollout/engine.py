"""The `RolloutEngine` and `TrainerPool` protocols and the plain data they speak.

An engine turns prompts (token ids) into completions with the logprob of every sampled token, takes the
trainer's weights as a stream of HF `(name, tensor)` pairs (exactly what `megatron_jetrl.models.hf_tensors`
yields: FP8 linears as `<name>.weight` E4M3 + `<name>.weight_scale_inv` FP32, the rest BF16), and can be
put to sleep while it shares its accelerator with the trainer.

Logprobs are *raw*: `log_softmax` of the model's logits at temperature 1, before temperature and top-p
(vLLM's default `logprobs_mode="raw_logprobs"`). This is what the trainer's forward recomputes, so the two
can be compared token for token (`megatron_jetrl.rollout.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_jetrl.rollout.sync import SyncStats


@dataclass(frozen=True)
class SamplingParams:
    """What to sample; the names follow vLLM's `SamplingParams` (`max_new_tokens` is its `max_tokens`)."""

    n: int = 1
    temperature: float = 1.0
    """0 (or below 1e-5): greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches `top_p`."""
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded completion contains one (needs a tokenizer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (kept in `token_ids`), in addition to the model's EOS."""
    ignore_eos: bool = False
    seed: int | None = None
    """Base seed: prompt i of a call gets request seed `seed + i` (see `request_seeds` of `generate`)."""

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled tokens; a stop token id (or the token completing a stop string) is included."""
    logprobs: list[float]
    """Raw logprob of each sampled token (temperature 1, no top-p), same length as `token_ids`."""
    finish_reason: str
    """`stop` (EOS, stop token id or stop string) or `length` (max_new_tokens reached)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it (None for EOS-by-config and length)."""
    text: str | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    request_seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the GRPO loop needs from a rollout engine (native, vLLM, or a pool of either)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, request_seeds: Sequence[int] | None = None
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order, each with `sampling.n` completions."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Install HF-named tensors (FP8 bytes + scales, BF16 rest); validate all, then apply, or raise."""
        ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class TrainerPool(Protocol):
    """The rollout engines of a run, all of them together, as the GRPO loop uses them: every method is called by
    every rank (collective), and the loop reaches for nothing else. Two kinds: the native engines served from global
    rank 0 (`rollout.pool.RankZeroPool`) and one vLLM engine per rank (`rollout.colocated.ColocatedPool`)."""

    weight_target: str
    """Where the actor's weight stream goes: "rank0" (gathered there) or "all" (every rank's engine takes it)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, request_seeds: Sequence[int] | None = None
    ) -> list[RequestOutput]:
        """Every rank gets the same outputs: one per prompt, in prompt order; an engine's error raises on every rank."""
        ...

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """The actor's stream (this rank's share of it) into the engines, which are awake after it; time and bytes."""
        ...

    def sleep(self) -> None:
        """The rollout is over: the engines give the trainer the device memory they can until the next `sync`."""
        ...

    def unmapped_bytes(self) -> int:
        """Device bytes the sleeping engines no longer hold that torch's allocator counters still count."""
        ...

    def metrics(self) -> dict[str, float]:
        """The last rollout's pool metrics (`rollout/...`), the same on every rank; {} when there are none."""
        ...


def request_seeds_for(sampling: SamplingParams, count: int, offset: int = 0) -> list[int] | None:
    """Per-prompt seeds `seed + offset + i` (None when unseeded): the pool passes global offsets so a prompt
    samples the same tokens whichever engine serves it."""
    if sampling.seed is None:
        return None
    return [sampling.seed + offset + i for i in range(count)]
