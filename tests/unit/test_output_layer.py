"""`actor.output_layer.TokenMajorOutputLayer`: GPTModel's lm_head with its logits computed sample by sample, so that
GPTModel's `transpose(0, 1).contiguous()` of the logits copies nothing.

On gloo ranks (TP 1, TP 2, TP 2 with sequence parallelism, vocabulary-parallel logits): the logits are megatron's
`ColumnParallelLinear` logits after GPTModel's transpose to the bit, the input's gradient equals megatron's, and the
weight's gradient (into DDP's FP32 `main_grad`, fused or not) is the FP64 product within FP32 rounding. The actor
built by `build_model` has it, except where its output layer is replaced by the batch-invariant or the engine's GEMM,
and the model's logits are the output layer's own tensor (no copy).
"""

from __future__ import annotations

import pytest
import torch
from actor_helpers import spawn, tp_rank_config

VOCAB, HIDDEN, SEQ, BATCH = 96, 128, 8, 3


def _on_a_rank(sequence_parallel: bool) -> dict:
    """Both WGrad paths (fused into main_grad or not) on this rank."""
    return {fuse: _compare(sequence_parallel, fuse) for fuse in (False, True)}


def _compare(sequence_parallel: bool, fuse: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_jetrl.actor.output_layer import TokenMajorOutputLayer, use_output_layer
    from megatron_jetrl.actor.wgrad_fusion import PATCH
    from megatron_jetrl.patching import load_patch

    load_patch(PATCH).apply()
    cfg, tp, rank = tp_rank_config(HIDDEN, sequence_parallel, torch.float32)
    g = torch.Generator().manual_seed(3)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # [s, b, h], the final norm's output
    weight_full = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    dy_full = torch.randn(BATCH, SEQ, VOCAB, generator=g)  # the logits' gradient, [b, s, V] as GPTModel returns them
    shard = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp) if sequence_parallel else slice(None)

    def run(token_major: bool):
        m = ColumnParallelLinear(HIDDEN, VOCAB, config=cfg, init_method=lambda w: None, bias=False, gather_output=False)
        if token_major:
            use_output_layer(type("Stage", (), {"output_layer": m})(), TokenMajorOutputLayer)
            assert type(m) is TokenMajorOutputLayer
        with torch.no_grad():
            m.weight.copy_(weight_full[shard])
        m.gradient_accumulation_fusion = fuse
        m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32)
        m.weight.grad_added_to_main_grad = False
        x = x_full[rows].clone().requires_grad_(True)
        y = m(x)[0]
        logits = y.transpose(0, 1).contiguous()  # GPTModel's return
        copied = logits.data_ptr() != y.data_ptr()
        logits.backward(dy_full[..., shard])
        grad = m.weight.main_grad if fuse else m.weight.grad.float() + m.weight.main_grad
        return logits.detach(), x.grad, grad, copied

    ref, dx_ref, _, copied_ref = run(token_major=False)
    logits, dx, dw, copied = run(token_major=True)
    exact = torch.einsum("bsv,sbh->vh", dy_full.double(), x_full.double())[shard]
    return {
        "logits": torch.equal(logits, ref),
        "dx": float((dx - dx_ref).abs().max() / dx_ref.abs().max()),
        "dw_err": float((dw.double() - exact).abs().max() / exact.abs().max()),
        "copied": (copied_ref, copied),
    }


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_token_major_logits_are_megatrons_without_the_copy(tp, sequence_parallel):
    for r in (by_fuse[fuse] for by_fuse in spawn(tp, tp, 1, _on_a_rank, sequence_parallel) for fuse in (False, True)):
        assert r["logits"], r  # megatron's logits, to the bit
        assert r["copied"] == (True, False), r  # GPTModel's transpose copied megatron's logits, not these
        assert r["dx"] < 1e-6, r  # the same products, summed in the GEMM's order
        assert r["dw_err"] < 1e-5, r  # FP32 sums of SEQ x BATCH products


def _both_built():
    return [_built({}), _built({"batch_invariant": True})]


def _built(options):
    import dataclasses

    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    arch = ModelArch.from_hf_config(
        dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(arch, PrecisionFlow("bf16"), dataclasses.replace(ActorOptions(params_dtype=torch.float32), **options))
    seen = {}
    model.output_layer.register_forward_hook(lambda m, args, out: seen.update(y=out[0]))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    return type(model.output_layer).__name__, logits.data_ptr() == seen["y"].data_ptr(), tuple(logits.shape)


def test_the_actor_returns_the_output_layers_own_logits():
    (name, same, shape), (batch_invariant, _, _) = spawn(1, 1, 1, _both_built)[0]
    assert name == "TokenMajorOutputLayer" and same and shape[:2] == (BATCH, SEQ)  # (the vocabulary padded)
    assert batch_invariant == "BatchInvariantColumnParallelLinear"
