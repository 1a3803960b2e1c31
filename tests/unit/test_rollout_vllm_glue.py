"""`rollout.vllm_glue` on the CPU: vLLM's RMSNorm and rotary calling conventions, computed with the trainer's
functions bit for bit. The registration into vLLM runs on the GPU (`tools/diag_vllm_layers.py --glue trainer`)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.actor.fused import rms_norm, rope
from megatron_jetrl.rollout import vllm_glue


def test_norm_with_a_residual_normalizes_the_trainers_rounded_sum():
    g = torch.Generator().manual_seed(0)
    x, res = ((torch.randn(7, 256, generator=g) * s).bfloat16() for s in (3.0, 40.0))
    w = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    assert torch.equal(vllm_glue.norm(x, None, w, 1e-6), rms_norm(x, w, 1e-6))
    out, new_res = vllm_glue.norm(x, res, w, 1e-6)
    h = x + res  # the trainer's residual add, in BF16
    assert torch.equal(new_res, h) and torch.equal(out, rms_norm(h, w, 1e-6))
    exact_sum = (x.float() + res.float())  # what vLLM's reference normalizes: the FP32 sum
    assert not torch.equal(out, rms_norm(exact_sum, w.float(), 1e-6).bfloat16())


@settings(max_examples=20, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2]), tokens=st.integers(1, 40), seed=st.integers(0, 2**16),
       base=st.sampled_from([10000.0, 1e6]))
def test_rope_at_any_positions_is_the_trainers_rope_of_the_sequence(heads, kv, tokens, seed, base):
    """Tokens of a vLLM batch carry their own positions; each gets what the trainer's RoPE gives that position of a
    sequence (megatron layout [s, b, heads, d], megatron's tables for the sequence's own length)."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin
    from megatron_jetrl.actor.parallel import apply_cpu_patch_if_needed

    apply_cpu_patch_if_needed()
    d, max_pos = 128, 64
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = torch.randn(tokens, heads * d, generator=g).bfloat16()
    k = torch.randn(tokens, kv * d, generator=g).bfloat16()
    got_q, got_k = vllm_glue.rope(positions, q, k, head_size=d, base=base, max_positions=max_pos)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    table = (("rotary_base", base), ("rotary_percent", 1.0))
    cos, sin = rope_cos_sin(d, table, max_pos, torch.device("cpu"))
    for i, p in enumerate(positions.tolist()):  # the trainer's RoPE of a sequence, read at position p
        seq = torch.zeros(max_pos, 1, heads, d, dtype=torch.bfloat16)
        seq[p, 0] = q[i].view(heads, d)
        assert torch.equal(rope(seq, cos, sin)[p, 0].reshape(-1), got_q[i])
    _, none = vllm_glue.rope(positions, q, None, head_size=d, base=base, max_positions=max_pos)
    assert none is None
