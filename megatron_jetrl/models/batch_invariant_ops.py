"""Batch-invariant BF16 pieces of the forward, shared by the native engine and the actor: a row's result
depends on that row's data only.

The FP8 linears are batch invariant by construction (`megatron_jetrl.fp8`: exact FP64 block products,
fixed order across blocks). Everything else in the forward -- the BF16 lm_head, attention core, norms --
would, with library kernels, change in the last bits with the batch shape (BLAS picks kernels and
blockings by M; a CPU elementwise loop computes the tail of a tensor with a scalar `exp`, the body with
a vector one). Then KV-cache decode would not reproduce the full-sequence score, and a sequence's
logprobs would depend on its batch neighbours. So these helpers use only:

* elementwise IEEE `+ - * /` and `sqrt` (correctly rounded, the same on every path and device);
* `tree_sum`: sums the last dim by adding *adjacent pairs* level by level, after zero-padding to a power
  of two. The tree over positions 0..n-1 does not depend on the padded length (extra nodes add exact
  zeros), so a masked/shorter key range gives the same bits as the unmasked prefix;
* transcendental functions (`exp`, `log`, `cos`/`sin`, sigmoid) evaluated in FP64 and rounded to FP32:
  vector and scalar FP64 results differ by at most an FP64 ulp, which survives the rounding to FP32 only
  when it straddles an FP32 rounding boundary (about 2**-29 per element), i.e. in practice never;
* `max` (exact in any order).

Sequences are right-padded, so a token's position in its row is its position in the sequence: the same
tree in prefill, decode and teacher-forced scoring. The actor (`actor.fp8_layers`, `batch_invariant=True`)
runs these very functions in its megatron modules, so in mode `jetrl` on the emulated backend the actor's
logprobs and the engine's are the same bits. Everything here is differentiable (the softmax maxima are
detached: the result does not depend on them in exact arithmetic).
"""

from __future__ import annotations

import torch

# elements of a products tensor materialized at once (float32): bounds memory of the chunked loops
_CHUNK_ELEMS = 1 << 23


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by adjacent pairs (zero-padded to a power of two): `[..., n] -> [...]`."""
    n = x.shape[-1]
    size = 1
    while size < n:
        size *= 2
    if size != n:
        x = torch.nn.functional.pad(x, (0, size - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` in FP32 products and a `tree_sum` over K, returned in `x.dtype`."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k).float()
    w = weight.float()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
    cols = max(1, min(n, _CHUNK_ELEMS // max(1, k)))
    rows = max(1, _CHUNK_ELEMS // (cols * k))
    for r in range(0, x2.shape[0], rows):
        xr = x2[r : r + rows, None, :]
        for c in range(0, n, cols):
            out[r : r + rows, c : c + cols] = tree_sum(xr * w[None, c : c + cols, :])
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, n)


def exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log32(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def silu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(x)` in `x.dtype`, the sigmoid's `exp` in FP64."""
    x64 = x.double()
    return (x64 / (1.0 + torch.exp(-x64))).float().to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen2/Llama RMSNorm: FP32 statistics, `weight * normalized.to(x.dtype)`."""
    x32 = x.float()
    var = tree_sum(x32 * x32) / x32.shape[-1]
    normed = x32 / torch.sqrt(var + eps)[..., None]
    return weight * normed.to(x.dtype)


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, head_dim]` (FP32, HF "rotate_half" layout), computed in FP64 once."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise NotImplementedError(
                f"rope_scaling type {kind!r} is not supported by the native engine (default and llama3 are)"
            )
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """HF `_compute_llama3_parameters`."""
    import math

    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, D]`, cos/sin `[B, T, D]` (gathered at each token's position) -> x.dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """Causal attention over a right-padded key buffer, batch invariant.

    q `[B, H, Tq, D]`, k/v `[B, Hkv, Tk, D]` (BF16), q_pos `[B, Tq]` (each query's position),
    k_len `[B]` (valid keys per row). Query at position p sees keys `j <= p` and `j < k_len`.
    Returns `[B, H, Tq, D]` in q's dtype.
    """
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rep = h // hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vt = v.float().repeat_interleave(rep, dim=1).transpose(-1, -2)  # [B, H, D, Tk]
    qf = q.float()
    scale = 1.0 / float(d) ** 0.5
    keys = torch.arange(tk, device=q.device)
    valid = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < k_len[:, None, None])  # [B, Tq, Tk]
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, b * h * tk * d))
    for s in range(0, tq, step):
        qs = qf[:, :, s : s + step]  # [B, H, t, D]
        scores = tree_sum(qs[:, :, :, None, :] * kf[:, :, None, :, :]) * scale  # [B, H, t, Tk]
        mask = valid[:, None, s : s + step, :]
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
        top = scores.amax(dim=-1, keepdim=True).detach()
        e = torch.where(mask, exp32(scores - top), torch.zeros_like(scores))
        p = e / tree_sum(e)[..., None]
        out[:, :, s : s + step] = tree_sum(p[:, :, :, None, :] * vt[:, :, None, :, :])  # [B, H, t, D]
    return out.to(q.dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise FP32 log-softmax over the last dim (max, FP64 exp/log, tree_sum)."""
    x = logits.float()
    top = x.amax(dim=-1, keepdim=True).detach()
    shifted = x - top
    return shifted - log32(tree_sum(exp32(shifted)))[..., None]
