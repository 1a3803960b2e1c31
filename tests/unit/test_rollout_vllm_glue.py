"""`rollout.vllm_glue` on the CPU: vLLM's RMSNorm and rotary calling conventions, computed with the trainer's
functions bit for bit. The registration into vLLM runs on the GPU (`tools/gpu/diag_vllm_layers.py --glue trainer`)."""

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
    exact_sum = x.float() + res.float()  # what vLLM's reference normalizes: the FP32 sum
    assert not torch.equal(out, rms_norm(exact_sum, w.float(), 1e-6).bfloat16())


@settings(max_examples=20, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    kv=st.sampled_from([1, 2]),
    tokens=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    base=st.sampled_from([10000.0, 1e6]),
)
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
    tables = vllm_glue.rope_tables(d, base, max_pos, "cpu")
    got_q, got_k = vllm_glue.rope(positions, q, k, *tables)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    table = (("rotary_base", base), ("rotary_percent", 1.0))
    cos, sin = rope_cos_sin(d, table, max_pos, torch.device("cpu"))
    assert torch.equal(tables[0], cos) and torch.equal(tables[1], sin)
    for i, p in enumerate(positions.tolist()):  # the trainer's RoPE of a sequence, read at position p
        seq = torch.zeros(max_pos, 1, heads, d, dtype=torch.bfloat16)
        seq[p, 0] = q[i].view(heads, d)
        assert torch.equal(rope(seq, cos, sin)[p, 0].reshape(-1), got_q[i])
    _, none = vllm_glue.rope(positions, q, None, *tables)
    assert none is None


def test_probe_reads_zero_for_the_trainers_glue_and_names_vllms_rounding():
    """The start-up probe of `VllmEngine(glue=...)`, on stand-ins of vLLM's modules: the trainer's functions read 0;
    a norm that rounds once at the end (torch's `F.rms_norm`, like vLLM 0.26's kernel) and BF16 RoPE tables do not."""
    from types import SimpleNamespace

    from megatron_jetrl.models import ModelArch

    arch = ModelArch.from_hf_config(
        dict(
            model_type="qwen2",
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=300,
            max_position_embeddings=128,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        )
    )
    w = (1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(0))).bfloat16()

    def layer(norm, rotate):
        return SimpleNamespace(input_layernorm=Norm(norm), self_attn=SimpleNamespace(rotary_emb=Rot(rotate)))

    class Norm:
        def __init__(self, fn):
            self.fn, self.weight = fn, w

        def __call__(self, x, residual=None):
            return self.fn(x, residual)

    class Rot:
        base = 1e6

        def __init__(self, fn):
            self.fn = fn

        def __call__(self, positions, q, k):
            return self.fn(positions, q, k)

    def trainer_rope(positions, q, k):
        return vllm_glue.rope(positions, q, k, *vllm_glue.rope_tables(128, 1e6, 1024, "cpu"))

    def bf16_rope(positions, q, k):  # vLLM's own: BF16 tables and BF16 math
        from megatron_jetrl.actor.fp8_layers import rope_cos_sin

        tables = rope_cos_sin(128, (("rotary_base", 1e6), ("rotary_percent", 1.0)), 1024, torch.device("cpu"))
        cos, sin = (t[positions].view(-1, 1, 128).bfloat16() for t in tables)

        def rot(t):
            t = t.view(t.shape[0], -1, 128)
            x1, x2 = t.chunk(2, -1)
            return (t * cos + torch.cat((-x2, x1), -1) * sin).flatten(1)

        return rot(q), rot(k)

    def vllm_norm(x, residual=None):  # vLLM's reference: one rounding at the end, the FP32 sum normalized
        if residual is None:
            return torch.nn.functional.rms_norm(x, (256,), w, 1e-6)
        h = x.float() + residual.float()
        return torch.nn.functional.rms_norm(h, (256,), w.float(), 1e-6).to(x.dtype), h.to(x.dtype)

    def trainer_norm(x, residual=None):
        return vllm_glue.norm(x, residual, w, 1e-6)

    ours = vllm_glue.probe(layer(trainer_norm, trainer_rope), arch, torch.device("cpu"))
    assert ours == {"rms_norm": 0.0, "rms_norm_residual": 0.0, "rope": 0.0}
    theirs = vllm_glue.probe(layer(vllm_norm, bf16_rope), arch, torch.device("cpu"))
    assert theirs["rms_norm"] > 0.1 and theirs["rms_norm_residual"] > 0.05 and theirs["rope"] > 0.05
    # `method` probes one forward of each module (the diag tool's per-method rows)
    both = layer(trainer_norm, trainer_rope)
    both.input_layernorm.forward_native = vllm_norm
    both.self_attn.rotary_emb.forward_native = bf16_rope
    assert vllm_glue.probe(both, arch, torch.device("cpu")) == ours
    assert vllm_glue.probe(both, arch, torch.device("cpu"), method="forward_native") == theirs


class Quant:
    """The attributes of vLLM's QuantFP8 that `take` reads: DeepGEMM's dynamic 1x128 quantizer, column-major
    TMA-aligned FP32 scales."""

    def __init__(self, **kw):
        self.is_group_quant, self.static, self.group_size, self.use_ue8m0 = True, False, 128, False
        self.column_major_scales, self.tma_aligned_scales = True, True
        self.__dict__.update(kw)


def _stashed(rows=6, width=256):
    y = torch.randn(rows, width).bfloat16()
    q = torch.zeros(rows, width, dtype=torch.float8_e4m3fn)
    s = torch.empty_strided((rows, width // 128), (1, vllm_glue.tma_rows(rows)), dtype=torch.float32)
    vllm_glue.stash(y, q, s)
    return y, q, s


def test_a_linear_takes_the_stash_only_for_the_stashed_tensor_unchanged_and_a_matching_quantizer():
    assert [vllm_glue.tma_rows(r) for r in (1, 4, 6, 128)] == [4, 4, 8, 128]
    y, q, s = _stashed()
    hits = vllm_glue.FUSED_QUANT["hits"]
    assert vllm_glue.take(torch.randn(6, 256).bfloat16(), Quant()) is None  # another tensor: vLLM quantizes it
    for op in (
        Quant(use_ue8m0=True),
        Quant(static=True),
        Quant(group_size=64),
        Quant(column_major_scales=False),
        Quant(tma_aligned_scales=False),
        Quant(is_group_quant=False),
    ):
        assert vllm_glue.take(y.view(-1, 256), op) is None  # another layout or format than the stash's
    with vllm_glue.unfused():
        assert vllm_glue.take(y.view(-1, 256), Quant()) is None
    got = vllm_glue.take(y.view(-1, 256), Quant())  # the linear's 2-D view of the norm's output
    assert got is not None and got[0] is q and got[1] is s and vllm_glue.FUSED_QUANT["hits"] == hits + 1
    assert vllm_glue.take(y.view(-1, 256), Quant()) is None  # taken once
    y, q, s = _stashed()
    y.mul_(2)  # changed after it was quantized
    assert vllm_glue.take(y, Quant()) is None
    y, q, s = _stashed(rows=8)  # 8 rows: TMA-aligned and plain column-major scales are the same layout
    assert vllm_glue.take(y, Quant(tma_aligned_scales=False))[1] is s
    y, q, s = _stashed()
    assert vllm_glue.take(y[1:], Quant()) is None  # a slice starts elsewhere
    with torch.inference_mode():  # vLLM's tensors: no version counter to compare, the rest still checked
        y, q, s = _stashed()
        assert vllm_glue.take(y[:, :128], Quant()) is None and vllm_glue.take(y.view(-1, 256), Quant())[0] is q
