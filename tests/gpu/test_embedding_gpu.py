"""`actor.embedding.MainGradEmbedding` on the GPU: the lookup's weight gradient added row by row into the FP32
`main_grad` (`index_put_` with accumulation) is the same bits on every run, however many tokens share an id (CUDA sorts
the ids first and adds each id's rows in one order), and the FP64 row sums within FP32 rounding; megatron's own
backward (a dense BF16 gradient added by DDP) for scale. CPU and TP 2: tests/unit/test_embedding_main_grad.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB, HIDDEN, TOKENS = 32000, 1024, 4 * 1088


@pytest.mark.parametrize("distinct", [16, 4000, VOCAB])  # ids a micro-batch draws from: heavy to rare repeats
def test_embedding_gradient_in_main_grad_is_deterministic_and_exact_to_fp32(parallel, distinct):
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    from megatron_jetrl.actor.embedding import MainGradEmbedding

    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, params_dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(distinct)
    ids = torch.randint(0, distinct, (4, TOKENS // 4), device="cuda", generator=g)
    dy = torch.randn(4, TOKENS // 4, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)

    def main_grad(cls):
        m = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=cfg).cuda()
        m.__class__ = cls
        m.weight.main_grad = torch.zeros(VOCAB, HIDDEN, dtype=torch.float32, device="cuda")
        m.weight.grad_added_to_main_grad = False
        m(ids).backward(dy)
        if not m.weight.grad_added_to_main_grad:  # megatron's: DDP's hook adds the dense BF16 gradient
            m.weight.main_grad.add_(m.weight.grad)
        return m.weight.main_grad

    runs = [main_grad(MainGradEmbedding) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64, device="cuda")
    exact.index_add_(0, ids.reshape(-1), dy.reshape(-1, HIDDEN).double())
    magnitude = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64, device="cuda")
    magnitude.index_add_(0, ids.reshape(-1), dy.reshape(-1, HIDDEN).double().abs())
    repeats = TOKENS / distinct
    assert bool(((runs[0].double() - exact).abs() <= 2.0**-23 * max(repeats, 1) * magnitude).all())
    megatron = main_grad(VocabParallelEmbedding)
    ours_err = (runs[0].double() - exact).abs().max()
    assert ours_err <= (megatron.double() - exact).abs().max()  # the dense BF16 gradient rounds each id's sum
