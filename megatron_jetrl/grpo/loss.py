"""The clipped policy loss of GRPO/DAPO with a KL penalty to the reference and optional truncated importance
sampling (TIS).

Per response token t of sequence b (mask 1), with A_b the sequence's advantage:

    ratio    r = exp(logprob - old_logprob)
    pg       max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))             (PPO; DAPO "clip-higher")
    TIS      pg *= w,  w = min(exp(old_logprob - rollout_logprob), tis_cap)  (detached)
    KL       with d = logprob - ref_logprob (estimators of KL(pi || pi_ref), tokens ~ pi):
             k1 = d,  k2 = d^2 / 2,  k3 = exp(-d) - 1 + d  (Schulman's low-variance estimator; not clamped)
    loss     agg(pg) + kl_coef * agg(KL)

TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training") corrects for
the rollout engine sampling from a slightly different policy than the trainer's `old_logprob` forward:
the importance weight pi_old / pi_rollout, capped at C. Under Jet-RL's identical FP8 flow w = 1.

Aggregation `agg` over the masked tokens:

    token-mean            sum over all tokens / number of tokens (every token weighs the same)
    seq-mean-token-mean   mean over sequences of each sequence's token mean (every sequence weighs the same)
    seq-mean-token-sum    mean over sequences of each sequence's token sum (Dr. GRPO-style, no length division)

Only `logprobs` carries gradient; old/ref/rollout logprobs and advantages are detached. Values under
mask 0 are never read (replaced by 0 first), so padding garbage, even inf/NaN, changes neither the loss
nor its gradient. Computed in FP32, or FP64 if `logprobs` is FP64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of `policy_loss` (module docstring)."""

    clip_low: float = 0.2
    """Ratios below 1 - clip_low stop the gradient of tokens with a negative advantage (PPO epsilon)."""
    clip_high: float = 0.28
    """Ratios above 1 + clip_high stop the gradient of tokens with a positive advantage (DAPO clip-higher;
    equal to clip_low for plain PPO/GRPO)."""
    kl_coef: float = 1e-3
    """Weight of the KL penalty to the reference policy (the Jet-RL paper uses 1e-3); 0 turns it off."""
    kl_estimator: str = "k3"
    """"k1", "k2", "k3" (low variance, GRPO's choice) or "none" (no KL term, no reference logprobs needed)."""
    agg: str = "token-mean"
    """"token-mean", "seq-mean-token-mean" or "seq-mean-token-sum" (module docstring)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap C (e.g. 2.0): the per-token loss is multiplied by
    min(exp(old_logprob - rollout_logprob), C), detached; needs rollout logprobs. None: off."""

    def __post_init__(self):
        problems = []
        if not 0 <= self.clip_low < 1:
            problems.append(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            problems.append(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.kl_coef >= 0:
            problems.append(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            problems.append(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.agg not in AGGREGATIONS:
            problems.append(f"agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            problems.append(f"tis_cap must be > 0 (or None to turn TIS off), got {self.tis_cap}")
        if problems:
            raise ValueError("invalid PolicyLossConfig: " + "; ".join(problems))

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has a KL term (and so needs reference logprobs)."""
        return self.kl_estimator != "none" and self.kl_coef > 0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (module docstring)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}: use one of {KL_ESTIMATORS[:3]}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the tokens where `mask` (bool) is set (module docstring)."""
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype))
    if agg == "token-mean":
        return masked.sum() / mask.sum()
    per_seq = masked.sum(dim=1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=1)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {agg!r}: use one of {AGGREGATIONS}")
    return per_seq.mean()


def _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, cfg) -> None:
    """Shapes, dtypes and the presence of what `cfg` needs; errors name the argument and the fix."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T] (sequences x response positions), got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs}
    for name, t in named.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {shape}: all per-token inputs must be [B, T]")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{shape[0]}] (one per sequence), got shape "
            f"{tuple(advantages.shape)}; broadcast per-token advantages are not supported"
        )
    for name, t in {"logprobs": logprobs, **named, "advantages": advantages}.items():
        if t is not None and name != "mask" and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    if cfg.uses_kl and ref_logprobs is None:
        raise ValueError(
            f"kl_estimator={cfg.kl_estimator!r} with kl_coef={cfg.kl_coef} needs ref_logprobs; "
            "pass them or set kl_estimator='none'"
        )
    if cfg.tis_cap is not None and rollout_logprobs is None:
        raise ValueError(
            f"tis_cap={cfg.tis_cap} needs rollout_logprobs (the engine's logprobs of the sampled "
            "tokens); pass them or set tis_cap=None"
        )


def check_mask(mask: torch.Tensor, agg: str, rows_per_loss: int | None = None) -> None:
    """The mask's values, in one host sync: only 0 and 1, and a response token wherever `agg` needs one (token-mean:
    in each loss call's rows; the per-sequence aggregations: in every sequence).

    `policy_loss` runs it on its own rows unless told that the caller did (`checked=True`). A trainer checks its
    whole batch once per step instead, with `rows_per_loss` = the micro-batch size: a sync per micro-batch would
    drain the GPU queue between every forward and its backward."""
    rows = mask.bool().any(dim=1)
    needed = rows
    if agg == "token-mean":
        per = rows_per_loss or len(rows)
        if len(rows) % per:
            raise ValueError(f"{len(rows)} rows do not split into losses of rows_per_loss={per}: pass the micro-batch size")
        needed = rows.view(-1, per).any(dim=1)
    binary = mask.dtype == torch.bool or ((mask == 0) | (mask == 1)).all()
    binary, complete = torch.stack([torch.as_tensor(binary, device=mask.device), needed.all()]).tolist()
    if not binary:
        raise ValueError("mask must hold only 0 and 1 (1 on response tokens)")
    if complete:
        return
    if agg == "token-mean":
        where = "" if rows_per_loss is None else f" in micro-batches {torch.nonzero(~needed).flatten().tolist()[:8]}"
        raise ValueError(f"mask selects no token{where}: the loss of an empty batch is undefined; drop the batch")
    empty = torch.nonzero(~rows).flatten().tolist()
    raise ValueError(
        f"sequences {empty[:8]} have no response token under the mask; with agg={agg!r} every "
        "sequence must have one: drop those rows or use agg='token-mean'"
    )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    checked: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss to minimize and detached metrics (module docstring).

    Shapes: logprobs, old_logprobs, ref_logprobs, rollout_logprobs, mask `[B, T]` (mask 1 on response
    tokens); advantages `[B]`. `ref_logprobs` is needed when `cfg.uses_kl`, `rollout_logprobs` when
    `cfg.tis_cap` is set (otherwise both are ignored). Shapes and dtypes are checked on every call; the mask's
    values (`check_mask`, a host sync) unless `checked`: the caller ran `check_mask` on the whole batch.

    Metrics (0-d tensors): `pg_loss` and `kl` aggregated like the loss (so loss = pg_loss + kl_coef * kl;
    `kl` only with a reference), and token means over the mask: `clip_frac` (tokens whose clipped term is
    the active one), `ratio_mean`, and with TIS `tis_weight_mean`, `tis_clip_frac` (tokens whose weight
    hit the cap).
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, cfg)
    if not checked:
        check_mask(mask, cfg.agg)
    mask = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype)

    def clean(t: torch.Tensor) -> torch.Tensor:  # masked-out entries never reach exp/log or the gradient
        return torch.where(mask, t.to(dtype), zero)

    lp, old = clean(logprobs), clean(old_logprobs.detach())
    adv = torch.where(mask.any(dim=1), advantages.detach().to(dtype), zero)[:, None]
    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_frac": aggregate((clipped > unclipped).to(dtype), mask, "token-mean"),
        "ratio_mean": aggregate(ratio.detach(), mask, "token-mean"),
    }
    if cfg.tis_cap is not None:
        raw = torch.exp(old - clean(rollout_logprobs.detach()))
        pg = pg * torch.clamp(raw, max=cfg.tis_cap)
        metrics["tis_weight_mean"] = aggregate(torch.clamp(raw, max=cfg.tis_cap), mask, "token-mean")
        metrics["tis_clip_frac"] = aggregate((raw > cfg.tis_cap).to(dtype), mask, "token-mean")
    loss = pg_loss = aggregate(pg, mask, cfg.agg)
    metrics["pg_loss"] = pg_loss.detach()
    if cfg.kl_estimator != "none" and ref_logprobs is not None:
        kl = aggregate(kl_estimate(lp, clean(ref_logprobs.detach()), cfg.kl_estimator), mask, cfg.agg)
        metrics["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    return loss, metrics
