"""The actor's fused glue on CUDA (`actor.fused`: RMSNorm and RoPE as Triton kernels, the logprobs through
torch.compile) against FP64 and against the eager formulas, forward and backward; and the local-spec layer with
and without it.

Bounds: BF16 keeps 8 significant bits, so one rounding of the output moves it by at most 2^-8 of its magnitude
(half an ulp; an ulp is at most 2^-7 relative). The compiled kernels may sum in another order (the RMS statistic)
or contract a multiply-add, which flips a rounding now and then: in a small fraction of the elements, by one ulp
of the rounded intermediate, and no further from FP64 than eager's own roundings.
"""

from __future__ import annotations

import pytest
import torch

from megatron_jetrl.actor import fused

pytestmark = pytest.mark.gpu

DEV = "cuda"
ULP = 2.0**-7  # BF16: an ulp relative to the magnitude, at most


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, atol: float = 0.0) -> bool:
    """|got - want| <= ulps BF16 ulps of |want| (+ atol: FP32 rounding where a sum cancels to ~0), elementwise."""
    got, want = got.double(), want.double()
    return bool(((got - want).abs() <= ulps * ULP * want.abs() + atol).all())


def rms_norm_64(x, w, eps):
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_64(t, cos, sin):
    t = t.double()
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos.double() + torch.cat((-x2, x1), dim=-1) * sin.double()


def flipped(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a != b).double().mean())


@pytest.mark.parametrize("shape", [(8192, 1, 4096), (1000, 3, 4096), (4096, 2, 32, 128), (17, 1, 8, 128)])
def test_rms_norm_compiled_equals_eager_and_fp64(shape):
    g = gen(0)
    x = (torch.randn(shape, device=DEV, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, device=DEV, generator=g))).bfloat16()
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV, generator=g)).bfloat16()
    dy = torch.randn(shape, device=DEV, generator=g).bfloat16()

    def run(fn, dtype=torch.bfloat16):  # FP64: the reference's inputs (and so its gradients) in FP64
        xx, ww = (v.to(dtype, copy=True).requires_grad_(True) for v in (x, w))
        y = fn(xx, ww, 1e-6)
        y.backward(dy.to(y.dtype))
        return y.detach(), xx.grad, ww.grad

    y_c, dx_c, dw_c = run(fused.fused_rms_norm)
    y_e, dx_e, dw_e = run(fused.rms_norm)
    y_64, dx_64, dw_64 = run(rms_norm_64, torch.float64)
    # forward: the eager formula rounds normalized x to BF16 and the product by the weight to BF16; so does the kernel.
    # Its RMS statistic may differ from eager's in the last FP32 bits (summation order, rsqrt): now and then that
    # flips the first rounding, by one ulp of the normalized value, which can be two ulps of the product's magnitude
    assert within_ulps(y_c, y_e, 2) and flipped(y_c, y_e) < 1e-3, flipped(y_c, y_e)
    assert within_ulps(y_c, y_64, 1.01)  # two roundings of half an ulp each
    # backward: gradients against FP64 autograd of the same formula, no worse than eager's
    for got, eager, want in ((dx_c, dx_e, dx_64), (dw_c, dw_e, dw_64)):
        err = float((got.double() - want).norm() / want.norm())
        err_eager = float((eager.double() - want).norm() / want.norm())
        assert err < 1e-2 and err <= 1.5 * err_eager + 1e-3, (err, err_eager)


@pytest.mark.parametrize("shape", [(8192, 1, 32, 128), (4096, 2, 8, 128), (33, 3, 4, 64)])
def test_rope_compiled_equals_eager_and_fp64(shape):
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    s, d = shape[0], shape[-1]
    rope_kw = (("rotary_base", 1_000_000.0), ("rotary_percent", 1.0))
    cos, sin = rope_cos_sin(d, rope_kw, s, torch.empty(0, device=DEV).device)
    g = gen(1)
    t = torch.randn(shape, device=DEV, generator=g).bfloat16()
    dy = torch.randn(shape, device=DEV, generator=g).bfloat16()

    def run(fn, dtype=torch.bfloat16):
        tt = t.to(dtype, copy=True).requires_grad_(True)
        y = fn(tt, cos, sin)
        y.backward(dy.to(y.dtype))
        return y.detach(), tt.grad

    y_c, dt_c = run(fused.fused_rope)
    y_e, dt_e = run(fused.rope)
    y_64, dt_64 = run(rope_64, torch.float64)
    # FP32 inside, one rounding to BF16: half an ulp from FP64, plus a few FP32 roundings of the two terms (atol;
    # it matters where they cancel, or where FP32 lands a value just across a BF16 rounding midpoint)
    atol = 4 * 2.0**-24 * 2 * float(max(t.abs().max(), dy.abs().max()))
    assert within_ulps(y_c, y_64, 0.5, atol) and within_ulps(dt_c, dt_64, 0.5, atol)
    assert within_ulps(y_c, y_e, 1, atol) and flipped(y_c, y_e) < 1e-3
    assert within_ulps(dt_c, dt_e, 1, atol) and flipped(dt_c, dt_e) < 1e-3


def test_rope_on_a_strided_view_and_positions():
    """megatron hands the core attention q/k as views of the fused QKV output: strided, not contiguous."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    s, b, h, d = 300, 2, 4, 128
    mixed = torch.randn(s, b, h, 3 * d, device=DEV, generator=gen(2)).bfloat16()
    q = mixed[..., d : 2 * d]
    assert not q.is_contiguous()
    cos, sin = rope_cos_sin(d, (("rotary_base", 10000.0), ("rotary_percent", 1.0)), s, torch.empty(0, device=DEV).device)
    got = fused.fused_rope(q, cos, sin)
    assert torch.equal(got[0], q[0])  # position 0 is the identity rotation
    assert within_ulps(got, rope_64(q, cos, sin), 0.5, 8 * 2.0**-24 * float(q.abs().max()))


@pytest.mark.parametrize("mode", ["bf16", "jetrl"])
def test_local_layer_fused_against_eager(parallel, mode):
    """The local-spec Qwen3-shaped layer (QK-norm, GQA) with `fused=True` against `fused=False` on the same weights:
    BF16 within a few roundings; jetrl within the FP8 noise a last-bit difference can trigger (an E4M3 flip)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_jetrl.actor.provider import ActorOptions, layer_spec, transformer_config
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    arch = ModelArch.from_hf_config(
        dict(
            model_type="qwen3",
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=1024,
            num_hidden_layers=1,
            max_position_embeddings=4096,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        )
    )
    flow = PrecisionFlow(mode=mode)
    outs, state = {}, None
    x0 = torch.randn(2048, 2, arch.hidden_size, device=DEV, generator=gen(3)).bfloat16()
    dy = torch.randn(x0.shape, device=DEV, generator=gen(4)).bfloat16() * 1e-2
    for fused_on in (True, False):
        options = ActorOptions(params_dtype=torch.bfloat16, fused=fused_on)
        config = transformer_config(arch, flow, tp=1, pp=1, options=options)
        layer = build_module(
            layer_spec(arch, flow, "local", 1, fused=fused_on).layer_specs[0], config=config, layer_number=1
        ).cuda()
        if state is None:
            state = {k: v.detach().clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
        layer.load_state_dict(state, strict=False)
        x = x0.clone().requires_grad_(True)
        y = layer(x, attention_mask=None)[0]
        y.backward(dy)
        outs[fused_on] = (y.detach() - x0, x.grad.detach(), layer.mlp.linear_fc1.weight.grad)
    bound = 2e-2 if mode == "bf16" else 6e-2
    for got, want in zip(outs[True], outs[False]):
        err = float((got.double() - want.double()).norm() / want.double().norm())
        assert err < bound, (mode, err)


@pytest.mark.parametrize(
    "rows,vocab,padded,temperature", [(4096, 151936, 151936, 1.0), (1000, 50000, 50048, 0.7), (17, 300, 384, 1.3)]
)
def test_logprobs_compiled_against_megatron_and_fp64(parallel, rows, vocab, padded, temperature):
    """The fused logprobs (three Inductor kernels reading BF16 logits) against megatron's cross entropy on FP32
    copies, same logits: values within FP32 summation-order noise of the log-sum-exp, gradients (BF16) equal
    but for a last-bit flip in a small fraction; and both against FP64."""
    from megatron_jetrl.actor.logprobs import shifted_logprobs

    g = gen(5)
    logits = (torch.randn(1, rows, padded, device=DEV, generator=g) * 3).bfloat16()
    tokens = torch.randint(0, vocab, (1, rows), device=DEV, generator=g)
    grad = torch.randn(1, rows - 1, device=DEV, generator=g)
    out = {}
    for fused_on in (True, False):
        x = logits.clone().requires_grad_(True)
        lp = shifted_logprobs(x, tokens, vocab, temperature, fused=fused_on)
        lp.backward(grad)
        out[fused_on] = (lp.detach(), x.grad)
    x64 = logits.double() / temperature
    x64[..., vocab:] = float("-inf")
    want = torch.log_softmax(x64, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    lse = float(torch.logsumexp(x64, -1).abs().max())
    for fused_on in (True, False):
        torch.testing.assert_close(out[fused_on][0].double(), want, atol=4 * 2.0**-24 * lse * 8, rtol=0)
    torch.testing.assert_close(out[True][0], out[False][0], atol=4 * 2.0**-24 * lse * 8, rtol=0)
    d_f, d_m = out[True][1], out[False][1]
    assert not d_f[:, -1].any() and not d_f[..., vocab:].any()
    assert within_ulps(d_f, d_m, 1, atol=2.0**-30) and flipped(d_f, d_m) < 1e-2


def test_rms_norm_on_a_strided_view():
    """megatron's k (no copy in its QKV split) reaches the k-norm as a strided view; the kernel reads it in place,
    and the gradient that comes back permuted (SDPA's layout) is read in place too."""
    s, b, g, d = 300, 2, 8, 128
    mixed0 = torch.randn(s, b, g, 6 * d, device=DEV, generator=gen(6)).bfloat16()
    w0 = (1 + 0.1 * torch.randn(d, device=DEV, generator=gen(7))).bfloat16()
    dy = torch.randn(b, s, g, d, device=DEV, generator=gen(8)).bfloat16().transpose(0, 1)
    out = {}
    for name, fn in (("kernel", fused.fused_rms_norm), ("eager", fused.rms_norm)):
        mixed, w = mixed0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        k = mixed[..., 4 * d : 5 * d]
        assert not k.is_contiguous() and not dy.is_contiguous()
        y = fn(k, w, 1e-6)
        y.backward(dy)
        out[name] = (y.detach(), mixed.grad[..., 4 * d : 5 * d], w.grad)
    assert within_ulps(out["kernel"][0], out["eager"][0], 2) and flipped(out["kernel"][0], out["eager"][0]) < 1e-3
    for got, want in zip(out["kernel"][1:], out["eager"][1:]):
        assert float((got.double() - want.double()).norm() / want.double().norm()) < 1e-2


@pytest.mark.parametrize("tokens", [1, 7, 128, 513, 4099])
@pytest.mark.parametrize("width", [4096, 2048, 1536, 1024, 640])
def test_norm_with_fused_quantization_writes_the_norm_and_the_quantizers_bytes(tokens, width):
    """`glue_kernels.rms_norm_quant` (vLLM's fused norm + FP8 activation quantization, `rollout.vllm_glue`): y and h are
    the unfused kernels' bits, q and s the quantizer's bytes of y, s in the given column stride; with a zero row (the
    eps floor), a tiny group and a non-finite row. Widths below 4096 put several rows in one program: a first version
    that reshaped y in registers summed those rows in another order (2e-5 of y's bits at width 1024, vLLM engine)."""
    from megatron_jetrl.actor.glue_kernels import rms_norm_quant
    from megatron_jetrl.fp8 import kernels

    x = (torch.randn(tokens, width, device=DEV, generator=gen(21)) * 3).bfloat16()
    r = (torch.randn(tokens, width, device=DEV, generator=gen(22)) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(width, device=DEV, generator=gen(23))).bfloat16()
    if tokens > 3:
        x[1], r[1] = 0.0, 0.0
        w[:128] = 1e-30
        x[3, 5] = float("inf")
    rows = -(-tokens // 4) * 4
    for residual in (None, r):
        y, h, q, s = rms_norm_quant(x, residual, w, 1e-6, 1e-10, rows)
        want_y, want_h = (fused.fused_rms_norm(x, w, 1e-6), None) if residual is None else fused.fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(y.view(torch.int16), want_y.view(torch.int16)) and (h is None or torch.equal(h, want_h))
        wq, ws = kernels.quantize_1x128(y, eps=1e-10, check_finite=False)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and s.stride() == (1, rows)
        assert torch.equal(s.contiguous().view(torch.int32), ws.contiguous().view(torch.int32))


@pytest.mark.parametrize("tokens", [1, 7, 128, 513])
def test_rollout_glue_kernels_equal_their_two_step_forms(tokens):
    """The vLLM trainer-glue kernels are bit for bit the steps they fuse: `add_rms_norm` = (fused_rms_norm(x + r),
    x + r), and `rope_at` = fused_rope at the gathered table rows (random positions, q and k shaped as vLLM's)."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    x = (torch.randn(tokens, 2048, device=DEV, generator=gen(11)) * 3).bfloat16()
    r = (torch.randn(tokens, 2048, device=DEV, generator=gen(12)) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(2048, device=DEV, generator=gen(13))).bfloat16()
    y, h = fused.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and torch.equal(y, fused.fused_rms_norm(x + r, w, 1e-6))
    cos, sin = rope_cos_sin(128, (("rotary_base", 1e6), ("rotary_percent", 1.0)), 4096, torch.empty(0, device=DEV).device)
    pos = torch.randint(0, 4096, (tokens,), device=DEV, generator=gen(14))
    for heads in (16, 4):
        q = torch.randn(tokens, 1, heads, 128, device=DEV, generator=gen(15 + heads)).bfloat16()
        assert torch.equal(
            fused.fused_rope_at(q, cos, sin, pos), fused.fused_rope(q, cos[pos].contiguous(), sin[pos].contiguous())
        )
