"""Train/rollout mismatch: how far the rollout's sampling distribution is from the trainer's.

Inputs are per-token logprobs of the *sampled* tokens: `train` from the trainer's forward (the old
policy), `rollout` from the engine that sampled them, as ragged lists or padded `[B, T]` tensors with a
mask. With `d = train - rollout` (log of the importance ratio r = pi_train / pi_rollout):

    mean_abs_diff      mean |d|; max_abs_diff: max |d|
    k3_kl              mean (r - 1) - log r      (k3 estimator of KL(rollout || train), tokens ~ rollout)
    exp_abs_diff       mean exp(|d|)             (1 when identical)
    abs_diff_gt1_frac  fraction of tokens with |d| > 1 (the rollout's probability off by more than a factor e)
    ratio_mean/min/max r statistics; ratio_clip_frac = fraction of tokens with r > tis_cap (truncated
                       importance sampling weights min(r, cap)); tis_weight_mean / tis_weight_std = mean / standard
                       deviation (over tokens) of min(r, cap): 1 / 0 when identical

All means are over tokens. `by_position` buckets the same statistics by the token's index in its
response (0-based), with bucket edges `position_edges` (the last bucket is open-ended). `by_length` buckets
whole responses by their length L (response tokens) in powers of two, [1, 2), [2, 4), [4, 8), ...: bucket
`len<2^k>-<2^(k+1)>` holds every token of the responses with 2^k <= L < 2^(k+1), with `LENGTH_STATS` only
(tokens, responses, mean_abs_diff, k3_kl, max_abs_diff, abs_diff_gt1_frac, and seq_abs_log_ratio: the mean over
the bucket's responses of |sum_t d_t| = |log pi_train(y) / pi_rollout(y)|, the sequence's log importance ratio,
which accumulates along the response). Position buckets ask whether late tokens of a response drift; length
buckets whether long rollouts do (the paper's finding: the foil's mismatch grows with rollout length). `by_confidence`
buckets tokens by the trainer's probability p = exp(train) of the sampled token, [0, 0.5), [0.5, 0.9), [0.9, 0.99),
[0.99, 1] (`CONFIDENCE_STATS`): where p is near 1 a perturbed logit moves log p little, so a sharp policy shows little
mismatch whatever its precision; these buckets tell that apart from a flow that matches. Empty buckets are left out,
not reported as 0 (every response has at least one token, so every response is in one).
In `jetrl` on the native CPU engine these are exactly 0 / 1; report them against the `bf16` floor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192)
LENGTH_STATS = ("tokens", "responses", "mean_abs_diff", "k3_kl", "max_abs_diff", "abs_diff_gt1_frac", "seq_abs_log_ratio")
CONFIDENCE_EDGES = (0.0, 0.5, 0.9, 0.99)
CONFIDENCE_STATS = ("tokens", "mean_abs_diff", "k3_kl", "max_abs_diff", "abs_diff_gt1_frac")


def _as_padded(values, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(values, torch.Tensor):
        v = values.double()
        m = torch.ones_like(v, dtype=torch.bool) if mask is None else mask.bool()
        if v.dim() == 1:
            v, m = v[None], m[None]
        return v, m
    rows = [list(map(float, r)) for r in values]
    t = max((len(r) for r in rows), default=0)
    v = torch.zeros(len(rows), t, dtype=torch.float64)
    m = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        v[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        m[i, : len(r)] = True
    if mask is not None:
        m &= _as_padded(mask)[0].bool() if not isinstance(mask, torch.Tensor) else mask.bool()
    return v, m


def _stats(d: torch.Tensor, cap: float) -> dict[str, float]:
    n = d.numel()
    if n == 0:
        return {"tokens": 0}
    r = torch.exp(d)
    return {
        "tokens": n,
        "mean_abs_diff": float(d.abs().mean()),
        "max_abs_diff": float(d.abs().max()),
        "k3_kl": float((r - 1 - d).mean()),
        "exp_abs_diff": float(torch.exp(d.abs()).mean()),
        "abs_diff_gt1_frac": float((d.abs() > 1).double().mean()),
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "ratio_clip_frac": float((r > cap).double().mean()),
        "tis_weight_mean": float(r.clamp(max=cap).mean()),
        "tis_weight_std": float(r.clamp(max=cap).std(unbiased=False)),
    }


def mismatch_metrics(
    train_logprobs, rollout_logprobs, mask=None, *, tis_cap: float = 2.0, position_edges: Sequence[int] = DEFAULT_EDGES
) -> dict:
    """Token-level mismatch statistics (module docstring), overall and `by_position`.

    `train_logprobs`/`rollout_logprobs`: ragged lists (one list per response) or `[B, T]` tensors;
    `mask` (optional, same layout) selects the tokens that count (e.g. response tokens only).
    """
    t, m1 = _as_padded(train_logprobs, mask)
    r, m2 = _as_padded(rollout_logprobs, mask)
    if t.shape != r.shape or not torch.equal(m1, m2):
        raise ValueError(
            f"train and rollout logprobs disagree in layout: {tuple(t.shape)} vs {tuple(r.shape)} "
            "(or different lengths per response)"
        )
    if tis_cap <= 0:
        raise ValueError(f"tis_cap must be positive, got {tis_cap}")
    d = t - r
    out = _stats(d[m1], tis_cap)
    pos = torch.arange(d.shape[1])[None].expand_as(d)
    edges = list(position_edges)
    if edges != sorted(edges) or not edges or edges[0] != 0:
        raise ValueError(f"position_edges must be increasing and start at 0, got {edges}")
    buckets = []
    for lo, hi in zip(edges, edges[1:] + [None]):
        sel = m1 & (pos >= lo) & ((pos < hi) if hi is not None else True)
        if sel.any():
            buckets.append({"start": lo, "end": hi, **_stats(d[sel], tis_cap)})
    out["by_position"] = buckets
    out["by_length"] = _length_buckets(d, m1, tis_cap)
    out["by_confidence"] = _confidence_buckets(t, d, m1, tis_cap)
    return out


def _confidence_buckets(train: torch.Tensor, d: torch.Tensor, mask: torch.Tensor, cap: float) -> list[dict]:
    """`by_confidence` (module docstring): tokens by the trainer's probability of the sampled token; the last bucket
    closed at 1."""
    p = torch.exp(train)
    edges = CONFIDENCE_EDGES + (None,)
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        sel = mask & (p >= lo) & ((p < hi) if hi is not None else True)
        if sel.any():
            stats = _stats(d[sel], cap)
            buckets.append({"start": lo, "end": 1.0 if hi is None else hi, **{k: stats[k] for k in CONFIDENCE_STATS}})
    return buckets


def _length_rows(lengths: torch.Tensor):
    """(lo, hi, rows) for each non-empty power-of-two length bucket [lo, hi); rows: a bool mask over responses."""
    longest = int(lengths.max()) if lengths.numel() else 0
    lo = 1
    while lo <= longest:
        rows = (lengths >= lo) & (lengths < 2 * lo)
        if rows.any():
            yield lo, 2 * lo, rows
        lo *= 2


def _length_buckets(d: torch.Tensor, mask: torch.Tensor, cap: float) -> list[dict]:
    """`by_length` (module docstring): responses of length in [2^k, 2^(k+1)), their tokens pooled."""
    seq_log_ratio = torch.where(mask, d, 0.0).sum(1)
    buckets = []
    for lo, hi, rows in _length_rows(mask.sum(1)):
        stats = _stats(d[mask & rows[:, None]], cap) | {
            "responses": int(rows.sum()),
            "seq_abs_log_ratio": float(seq_log_ratio[rows].abs().mean()),
        }
        buckets.append({"start": lo, "end": hi, **{k: stats[k] for k in LENGTH_STATS}})
    return buckets


def length_means(values: torch.Tensor, lengths: torch.Tensor, prefix: str) -> dict[str, float]:
    """`<prefix>len<lo>-<hi>`: the mean of per-response `values` (e.g. rewards) over each length bucket of `by_length`."""
    return {f"{prefix}len{lo}-{hi}": float(values[rows].double().mean()) for lo, hi, rows in _length_rows(lengths)}


def flat_metrics(metrics: dict, prefix: str = "mismatch/") -> dict[str, float]:
    """Scalars for a logger: overall stats, `<prefix>pos<start>-<end>/<stat>` per position bucket,
    `<prefix>len<start>-<end>/<stat>` per response-length bucket (end exclusive) and `<prefix>p<start>-<end>/<stat>`
    per confidence bucket (e.g. `p0.9-0.99`; the last, `p0.99-1`, includes 1)."""
    kinds = (("pos", "by_position"), ("len", "by_length"), ("p", "by_confidence"))
    flat = {f"{prefix}{k}": v for k, v in metrics.items() if k not in {key for _, key in kinds}}
    for kind, key in kinds:
        for b in metrics.get(key, []):
            edge = lambda v: "inf" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
            tag = f"{kind}{edge(b['start'])}-{edge(b['end'])}"
            flat.update({f"{prefix}{tag}/{k}": v for k, v in b.items() if k not in ("start", "end")})
    return flat
