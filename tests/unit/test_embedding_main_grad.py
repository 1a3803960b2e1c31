"""`actor.embedding.MainGradEmbedding`: megatron's vocabulary-parallel embedding whose weight gradient goes row by row
into DDP's FP32 `main_grad` instead of a dense `[vocab, hidden]` gradient per micro-batch.

On gloo ranks (TP 1 and TP 2, ids on both vocabulary shards, repeated ids, with and without sequence parallelism'
reduce-scatter): the forward is megatron's to the bit; `main_grad` gains the FP64 sum of each id's output-gradient
rows within FP32 rounding, on every rank's shard; the weight's returned gradient answers megatron's fused-gradient
protocol; without a `main_grad` the dense gradient is the FP64 sum within BF16 rounding. The actor's other tests
(TP 2 against TP 1, PP 2 against PP 1, whole GRPO runs) run through it too.
"""

from __future__ import annotations

import pytest
import torch
from actor_helpers import spawn, tp_rank_config

VOCAB, HIDDEN, SEQ, BATCH = 64, 128, 8, 3


def _on_a_rank(sequence_parallel: bool):
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_jetrl.actor.embedding import MainGradEmbedding, use_main_grad_embedding

    cfg, tp, rank = tp_rank_config(HIDDEN, sequence_parallel, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, :4] = 7  # repeated ids: their rows are summed
    dy_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(torch.bfloat16)  # [s, b, h], megatron's layout after it
    weight_full = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.1).to(torch.bfloat16)
    shard = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)

    def build():
        m = VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=lambda w: None, config=cfg, reduce_scatter_embeddings=sequence_parallel
        )
        with torch.no_grad():
            m.weight.copy_(weight_full[shard])
        return m

    def run(m, main_grad: bool):
        if main_grad:
            m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32)
            m.weight.grad_added_to_main_grad = False
        y = m(ids)  # [b, s, h] summed over TP, or [s / tp, b, h] this rank's rows under SP
        rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp) if sequence_parallel else slice(None)
        dy = dy_full[rows] if sequence_parallel else dy_full.transpose(0, 1)
        y.backward(dy)
        return y.detach()

    megatron = build()
    y_ref = run(megatron, main_grad=False)
    ours = build()
    assert use_main_grad_embedding(type("Stage", (), {"embedding": type("E", (), {"word_embeddings": ours})()})())
    assert type(ours) is MainGradEmbedding
    y = run(ours, main_grad=True)
    dense = build()
    dense.__class__ = MainGradEmbedding
    run(dense, main_grad=False)

    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    exact.index_add_(0, ids.reshape(-1), dy_full.transpose(0, 1).reshape(-1, HIDDEN).double())
    exact = exact[shard]
    scale = exact.abs().max()
    return {
        "forward": torch.equal(y, y_ref),
        "main_grad_err": float((ours.weight.main_grad.double() - exact).abs().max() / scale),
        "protocol": ours.weight.grad_added_to_main_grad and ours.weight.grad is not None,
        "dense_err": float((dense.weight.grad.double() - exact).abs().max() / scale),
        "megatron_err": float((megatron.weight.grad.double() - exact).abs().max() / scale),
    }


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_embedding_gradient_lands_in_main_grad_as_the_fp64_row_sums(tp, sequence_parallel):
    for r in spawn(tp, tp, 1, _on_a_rank, sequence_parallel):
        assert r["forward"], r  # megatron's bytes
        assert r["protocol"], r
        assert r["main_grad_err"] < 2**-20, r  # FP32 sums of a few BF16 rows
        assert r["dense_err"] <= 2**-8, r  # no main_grad: the dense gradient in the weight's BF16
        assert r["megatron_err"] <= 2**-8, r  # what megatron's own backward gives, for scale
