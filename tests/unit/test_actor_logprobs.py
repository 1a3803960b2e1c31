"""`actor.logprobs`: the fused vocab-parallel logprobs are megatron's cross entropy to the bit on the CPU (values
and logit gradients, TP1 and TP2 with a padded vocabulary), and match an FP64 log-softmax. (Compiled on CUDA:
tests/gpu/test_fused.py.)"""

from __future__ import annotations

import pytest
import torch
from actor_helpers import spawn
from gloo import one_gloo_rank
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB, PADDED = 300, 384  # padded vocabulary: 84 columns that are not tokens


@pytest.fixture(scope="module")
def one_rank():
    yield from one_gloo_rank()


def _case(seed: int, batch: int, seq: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, PADDED, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    grad = torch.randn(batch, seq - 1, generator=g)
    return logits, tokens, grad


def _both(logits_shard, tokens, grad, temperature):
    """(values, logit gradient) of the fused and of megatron's path on this rank's vocab shard."""
    from megatron_jetrl.actor.logprobs import shifted_logprobs

    out = []
    for fused in (True, False):
        x = logits_shard.clone().requires_grad_(True)
        lp = shifted_logprobs(x, tokens, VOCAB, temperature, fused=fused)
        lp.backward(grad)
        out.append((lp.detach(), x.grad))
    return out


def _fp64_reference(logits, tokens, temperature):
    x = logits.double() / temperature
    x[..., VOCAB:] = float("-inf")
    return torch.log_softmax(x, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    seq=st.integers(2, 9),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_fused_logprobs_are_megatrons_bits_at_tp1(one_rank, seed, batch, seq, temperature, dtype):
    logits, tokens, grad = _case(seed, batch, seq, dtype)
    (lp_f, d_f), (lp_m, d_m) = _both(logits, tokens, grad, temperature)
    assert lp_f.dtype == torch.float32 and d_f.dtype == dtype
    assert torch.equal(lp_f, lp_m)
    assert torch.equal(d_f, d_m)
    assert not d_f[:, -1].any() and not d_f[..., VOCAB:].any()  # no target after the last token; padding is no token
    torch.testing.assert_close(lp_f.double(), _fp64_reference(logits, tokens, temperature), atol=2e-5, rtol=0)


def _tp2(seed: int):
    from megatron.core import parallel_state as ps

    logits, tokens, grad = _case(seed, 2, 7)
    part = PADDED // 2
    rank = ps.get_tensor_model_parallel_rank()
    return {"logits": logits, "tokens": tokens, "results": _both(logits[..., rank * part : (rank + 1) * part], tokens, grad, 0.7)}


def test_fused_logprobs_are_megatrons_bits_at_tp2():
    """Rank 1's shard holds 108 tokens and 84 padding columns; targets fall on both ranks."""
    ranks = spawn(2, 2, 1, _tp2, 5)
    for r in ranks:
        (lp_f, d_f), (lp_m, d_m) = r["results"]
        assert torch.equal(lp_f, lp_m) and torch.equal(d_f, d_m)
    lp = ranks[0]["results"][0][0]
    assert torch.equal(lp, ranks[1]["results"][0][0])  # every TP rank gets the full logprobs
    torch.testing.assert_close(lp.double(), _fp64_reference(ranks[0]["logits"], ranks[0]["tokens"], 0.7), atol=2e-5, rtol=0)
