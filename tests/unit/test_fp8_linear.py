"""The Jet-RL FP8 linear: GEMM numerics, forward/backward against FP64 references, flow properties."""

import pytest
import torch

from megatron_jetrl.fp8 import (
    FP8Linear,
    NonFiniteInputError,
    PrecisionFlow,
    QuantizedWeight,
    blockwise_gemm,
    dequantize_blockwise,
    fp8_linear,
    fp8_linear_forward,
    fp8_linears_forward,
    quantize_blockwise,
)

JETRL = PrecisionFlow(mode="jetrl")


def deq64(q, s, block):
    """Exact dequantization: an E4M3 value times an FP32 scale fits in FP64."""
    bm, bk = block
    m, k = q.shape
    return q.double() * s.double().repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def quantized_pair(m, n, k, b_block, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, k, generator=g) * 0.05
    a_q, a_s = quantize_blockwise(a, (1, 128))
    b_q, b_s = quantize_blockwise(b, b_block)
    return a_q, a_s, b_q, b_s


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("shape", [(5, 7, 128), (33, 130, 300), (64, 256, 640)])
def test_emulated_gemm_is_the_fp64_product_of_the_dequantized_operands(shape, b_block):
    m, n, k = shape
    a_q, a_s, b_q, b_s = quantized_pair(m, n, k, b_block)
    exact = deq64(a_q, a_s, (1, 128)) @ deq64(b_q, b_s, b_block).T
    out = blockwise_gemm(a_q, a_s, b_q, b_s, b_block=b_block, out_dtype=torch.float32, backend="emulated")
    # Block products are exact; scaling and summing K/128 blocks in FP64 add ~K/128 * 2**-53 relative to
    # sum |terms|; the FP32 output rounding is at most 2**-24 of |out|.
    magnitude = deq64(a_q, a_s, (1, 128)).abs() @ deq64(b_q, b_s, b_block).abs().T
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2.0**-24 + magnitude * 1e-14)
    bf16 = blockwise_gemm(a_q, a_s, b_q, b_s, b_block=b_block, out_dtype=torch.bfloat16, backend="emulated")
    assert torch.all((bf16.double() - exact).abs() <= exact.abs() * 2.0**-8 + magnitude * 1e-14)


def test_emulated_gemm_is_batch_invariant():
    a_q, a_s, b_q, b_s = quantized_pair(48, 96, 384, (128, 128), seed=3)
    full = blockwise_gemm(a_q, a_s, b_q, b_s, out_dtype=torch.bfloat16, backend="emulated")
    for rows in (slice(0, 1), slice(7, 8), slice(10, 40)):
        part = blockwise_gemm(a_q[rows], a_s[rows], b_q, b_s, out_dtype=torch.bfloat16, backend="emulated")
        assert torch.equal(part.view(torch.int16), full[rows].view(torch.int16))


def test_gemm_refuses_bad_operands():
    a_q, a_s, b_q, b_s = quantized_pair(4, 128, 256, (128, 128))
    with pytest.raises(ValueError, match="scales must be"):
        blockwise_gemm(a_q, a_s[:, :1], b_q, b_s)
    with pytest.raises(ValueError, match="b_block"):
        blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(128, 1))
    with pytest.raises(RuntimeError, match="not available"):
        blockwise_gemm(a_q, a_s, b_q, b_s, backend="cublaslt")
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"):
        blockwise_gemm(a_q, a_s, b_q, b_s, backend="cutlass")


def fp64_reference(x, weight, bias, dy):
    """Forward and gradients from the same quantized operands the Jet-RL flow defines, in FP64."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    wq, ws = quantize_blockwise(weight, (128, 128))
    w_hat = deq64(wq, ws, (128, 128))
    x_q, x_s = quantize_blockwise(x2, (1, 128))
    y = deq64(x_q, x_s, (1, 128)) @ w_hat.T + bias.double()
    dx = deq64(*quantize_blockwise(dy2, (1, 128)), (1, 128)) @ w_hat
    dy_tok = deq64(*quantize_blockwise(dy2, (128, 1)), (128, 1))
    # WGrad re-quantizes the saved FP8 activation, dequantized in FP32 as the contract says
    x_tok = deq64(*quantize_blockwise(dequantize_blockwise(x_q, x_s, (1, 128)), (128, 1)), (128, 1))
    dw = dy_tok.T @ x_tok
    return y, dx, dw, dy2.double().sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,n", [(3 * 50, 256, 384), (300, 384, 256), (7, 128, 130)])
def test_forward_backward_match_fp64_reference_of_the_quantized_operands(tokens, k, n, dtype):
    torch.manual_seed(tokens + k)
    lin = FP8Linear(k, n, flow=JETRL, dtype=dtype)
    x = torch.randn(tokens, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, n, dtype=dtype) * 1e-2
    y = lin(x)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = fp64_reference(x.detach(), lin.weight.detach(), lin.bias.detach(), dy)
    # Only the output rounding separates us from the FP64 product (see the GEMM test above):
    # 2**-24 relative in FP32, 2**-8 in BF16 (the bias add in the output dtype adds one more rounding).
    tol = 2.0**-22 if dtype == torch.float32 else 2.0**-7
    for got, want in ((y, y_ref), (x.grad, dx_ref), (lin.weight.grad, dw_ref), (lin.bias.grad, db_ref)):
        assert got.dtype == dtype
        assert rel_err(got, want) <= tol, (got.shape, rel_err(got, want))


def test_fp8_linear_stays_within_quantization_bounds_of_the_unquantized_op():
    torch.manual_seed(0)
    k, n, tokens = 512, 384, 256
    lin = FP8Linear(k, n, flow=JETRL, dtype=torch.float32)
    x = torch.randn(tokens, k, requires_grad=True)
    dy = torch.randn(tokens, n)
    lin(x).backward(dy)
    xd, wd = x.detach().double(), lin.weight.detach().double()
    y = xd @ wd.T + lin.bias.detach().double()
    # RNE onto 3 mantissa bits errs by at most 2**-4 relative, uniformly spread: RMS 2**-4/sqrt(3) = 3.6%.
    # A GEMM of two independently quantized operands has relative Frobenius error ~ the root-sum-square of
    # theirs (5.1%); WGrad re-quantizes X once more (three terms, 6.3%). Bounds: those RMS figures, with
    # no credit taken for averaging over K.
    y_fp8 = fp8_linear_forward(x.detach(), lin.quantized_weight(), lin.bias.detach(), flow=JETRL)
    assert 0.01 < rel_err(y_fp8, y) < 0.051
    assert 0.01 < rel_err(x.grad, dy.double() @ wd) < 0.051
    assert 0.01 < rel_err(lin.weight.grad, dy.double().T @ xd) < 0.063


def test_training_and_rollout_forward_are_byte_equal():
    lin = FP8Linear(256, 384, flow=JETRL, dtype=torch.bfloat16)
    x = torch.randn(2, 9, 256, dtype=torch.bfloat16)
    train = lin(x.clone().requires_grad_())
    rollout = lin.rollout_forward(x)
    functional = fp8_linear_forward(x, lin.quantized_weight(), lin.bias, flow=JETRL)
    assert torch.equal(train.detach().view(torch.int16), rollout.view(torch.int16))
    assert torch.equal(rollout.view(torch.int16), functional.view(torch.int16))


@pytest.mark.parametrize("act", [None, torch.nn.functional.silu])
def test_forward_without_gradients_is_the_training_forward_without_an_autograd_node(act, monkeypatch):
    """Under no_grad (the old and reference logprobs) `fp8_linear` skips the autograd Function: the same bits, no node,
    nothing saved; with gradients on it builds the node as before."""
    from megatron_jetrl.fp8 import linear

    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 384, generator=g).to(torch.bfloat16).requires_grad_(True)
    b = torch.randn(256, generator=g).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(2, 9, 768 if act else 384, generator=g).to(torch.bfloat16)
    trained = fp8_linear(x.clone().requires_grad_(True), w, b if act is None else None, flow=JETRL, gated_act=act)
    saved = []
    monkeypatch.setattr(linear._FP8LinearFunction, "apply", lambda *a: pytest.fail("autograd Function under no_grad"))
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        evaluated = fp8_linear(x.clone().requires_grad_(True), w, b if act is None else None, flow=JETRL, gated_act=act)
    assert trained.grad_fn is not None and evaluated.grad_fn is None and not evaluated.requires_grad and not saved
    assert torch.equal(trained.detach().view(torch.int16), evaluated.view(torch.int16))


def test_linears_sharing_an_input_are_each_the_single_linear_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 384, generator=g).to(torch.bfloat16)
    weights = [QuantizedWeight.quantize(torch.randn(n, 384, generator=g), JETRL) for n in (256, 128, 128)]
    biases = [torch.randn(256, generator=g).to(torch.bfloat16), None, None]
    shared = fp8_linears_forward(x, weights, biases, flow=JETRL)
    for y, w, b in zip(shared, weights, biases):
        assert torch.equal(y.view(torch.int16), fp8_linear_forward(x, w, b, flow=JETRL).view(torch.int16))
    with pytest.raises(ValueError):
        fp8_linears_forward(x, weights, biases[:2], flow=JETRL)


def test_fp8_activation_not_bf16_is_saved_for_backward():
    saved = []
    lin = FP8Linear(256, 256, flow=JETRL, dtype=torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lin(x)
    assert {t.dtype for t in saved} == {torch.float8_e4m3fn, torch.float32}
    assert all(t.numel() <= x.numel() // 128 for t in saved if t.dtype == torch.float32)


def test_weight_is_quantized_once_per_optimizer_step(monkeypatch):
    import megatron_jetrl.fp8.linear as linear_mod

    calls = []
    real = linear_mod.QuantizedWeight.quantize.__func__
    monkeypatch.setattr(
        linear_mod.QuantizedWeight, "quantize", classmethod(lambda cls, w, f, **kw: calls.append(1) or real(cls, w, f, **kw))
    )
    lin = FP8Linear(128, 256, flow=JETRL)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches, one weight version
        lin(torch.randn(4, 128)).sum().backward()
    assert len(calls) == 1
    before = lin.quantized_weight().q.view(torch.uint8).clone()
    opt.step()
    lin(torch.randn(4, 128))
    assert len(calls) == 2 and not torch.equal(before, lin.quantized_weight().q.view(torch.uint8))
    lin.weight.data = lin.weight.data.clone()  # a swapped tensor invalidates too
    lin(torch.randn(4, 128))
    assert len(calls) == 3


def test_functional_api_takes_a_prequantized_weight():
    w = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    wq = QuantizedWeight.quantize(w, JETRL)
    assert torch.equal(fp8_linear(x, w, flow=JETRL, weight_q=wq), fp8_linear(x, w, flow=JETRL))


def test_bf16_mode_is_a_plain_linear_and_the_foil_quantizes_only_rollout():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    for mode in ("bf16", "bf16-train-fp8-rollout"):
        lin = FP8Linear(256, 128, flow=PrecisionFlow(mode=mode), dtype=torch.bfloat16)
        plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert torch.equal(lin(x), plain)
        rollout = lin.rollout_forward(x)
        assert torch.equal(rollout, plain) == (mode == "bf16")
    foil = FP8Linear(256, 128, flow=PrecisionFlow(mode="bf16-train-fp8-rollout"), dtype=torch.bfloat16)
    jet = FP8Linear(256, 128, flow=JETRL, dtype=torch.bfloat16)
    jet.load_state_dict(foil.state_dict())
    assert torch.equal(foil.rollout_forward(x), jet.rollout_forward(x))


# ---- WGrad into megatron's main_grad, and non-finite inputs found on the device ---------------------------


def test_gemm_accumulates_into_an_fp32_buffer_as_a_separate_add_would():
    a_q, a_s, b_q, b_s = quantized_pair(200, 256, 384, (1, 128))
    start = torch.randn(200, 256)
    acc = start.clone()
    assert blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(1, 128), backend="emulated", acc=acc) is acc
    separate = blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(1, 128), out_dtype=torch.float32, backend="emulated")
    assert torch.equal(acc, start + separate)
    with pytest.raises(ValueError, match=r"acc must be a contiguous FP32 \[200, 256\] buffer .*, got torch.bfloat16"):
        blockwise_gemm(a_q, a_s, b_q, b_s, b_block=(1, 128), backend="emulated", acc=start.bfloat16())


def _wgrad_operands(x, dy):
    """WGrad's operands as the linear makes them: dY and X (through its 1x128 bytes) grouped along tokens."""
    x_q, x_s = quantize_blockwise(x, (1, 128))
    xt_q, xt_s = quantize_blockwise(dequantize_blockwise(x_q, x_s, (1, 128)), (128, 1))
    dyt_q, dyt_s = quantize_blockwise(dy, (128, 1))
    return dyt_q.t(), dyt_s.t(), xt_q.t(), xt_s.t()


@pytest.mark.parametrize("under_ddp", [False, True])
def test_wgrad_lands_in_main_grad_in_fp32(under_ddp):
    """With `main_grad` (megatron DDP's FP32 buffer) WGrad is added there in FP32 and no BF16 dW is made; under
    DDP's protocol (`grad_added_to_main_grad`) the flag is set and a placeholder goes to the DDP hook."""
    g = torch.Generator().manual_seed(3)
    plain = FP8Linear(256, 384, bias=False, flow=JETRL, dtype=torch.bfloat16)
    fused = FP8Linear(256, 384, bias=False, flow=JETRL, dtype=torch.bfloat16)
    fused.weight.data.copy_(plain.weight.data)
    start = torch.randn(384, 256, generator=g)
    fused.weight.main_grad = start.clone()
    if under_ddp:
        fused.weight.grad_added_to_main_grad = False
    x = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    dy = torch.randn(130, 384, generator=g).to(torch.bfloat16)
    plain(x).backward(dy)
    fused(x).backward(dy)
    # the same FP32 product: plain's dW is it rounded to BF16; main_grad holds start + it, rounded once in FP32
    dw = blockwise_gemm(*_wgrad_operands(x, dy), b_block=(1, 128), out_dtype=torch.float32, backend="emulated")
    assert torch.equal(dw.to(torch.bfloat16), plain.weight.grad)
    assert torch.equal(fused.weight.main_grad, start + dw)
    if under_ddp:
        assert fused.weight.grad_added_to_main_grad is True and fused.weight.grad is not None  # the placeholder
    else:
        assert fused.weight.grad is None


@pytest.fixture
def one_rank():
    from gloo import one_gloo_rank

    yield from one_gloo_rank()


@pytest.mark.parametrize("gated", [False, True])
def test_dgrad_all_reduce_starts_before_wgrad_and_is_awaited_before_backward_returns(monkeypatch, one_rank, gated):
    """With `dgrad_group` (a column-parallel linear's TP group) the input gradient's all-reduce is started right after
    DGrad, WGrad runs while it is in flight, and it is awaited before the gradient goes back to autograd; the gradients
    are those of the linear without it (one gloo rank: the sum over the group is the rank's own). An up projection that
    takes its d[gate | up] from the down projection (`GatedGradHandoff`) does the same. BF16 training has no FP8
    backward to carry the all-reduce, and a gated (down) projection's input is not reduced: both refused."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_jetrl.fp8 import linear
    from megatron_jetrl.fp8.linear import GatedGradHandoff

    events = []
    gemm, all_reduce = linear.blockwise_gemm, dist.all_reduce

    class Handle:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def logged_gemm(*args, **kw):
        events.append("wgrad" if kw.get("b_block") == linear.TOKENS_T else "gemm")
        return gemm(*args, **kw)

    def logged_all_reduce(tensor, group=None, async_op=False):
        events.append("all_reduce")
        work = all_reduce(tensor, group=group, async_op=async_op)
        return Handle(work) if async_op else work

    monkeypatch.setattr(linear, "blockwise_gemm", logged_gemm)
    monkeypatch.setattr(dist, "all_reduce", logged_all_reduce)
    g = torch.Generator().manual_seed(11)
    w_up = (torch.randn(512, 256, generator=g) * 0.05).to(torch.bfloat16)
    w_down = (torch.randn(256, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    dy = torch.randn(130, 256, generator=g).to(torch.bfloat16)

    def run(group):
        up, down, inp = (t.clone().requires_grad_(True) for t in (w_up, w_down, x))
        if gated:  # the up projection's gradient operands come from the down projection's backward
            handoff = GatedGradHandoff()
            h = fp8_linear(inp, up, flow=JETRL, handoff=handoff, dgrad_group=group)
            y = fp8_linear(h, down, flow=JETRL, gated_act=F.silu, handoff=handoff)
        else:
            y = fp8_linear(inp, up[:256], flow=JETRL, dgrad_group=group)
        y.backward(dy)
        return inp.grad, up.grad, down.grad

    want = run(None)
    assert "all_reduce" not in events
    events.clear()
    got = run(dist.group.WORLD)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
    up_backward = events[events.index("all_reduce") - 1 :]
    assert up_backward == ["gemm", "all_reduce", "wgrad", "wait"]  # DGrad, the reduce started, WGrad, then the wait
    with pytest.raises(ValueError, match="trains in BF16: reduce the input's gradient outside"):
        fp8_linear(x, w_up, flow=PrecisionFlow(mode="bf16"), dgrad_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="a gated \\(down\\) projection is row-parallel"):
        fp8_linear(torch.cat([x, x], dim=1), w_down, flow=JETRL, gated_act=F.silu, dgrad_group=dist.group.WORLD)


def test_gemm_sms_limits_deepgemm_once_per_change_and_keeps_the_bytes(monkeypatch):
    """precision.gemm_sms reaches DeepGEMM's set_num_sms at the first GEMM that runs with a new count (one call for
    FProp, DGrad and WGrad), 0 gives back all of the device's SMs, the bytes are those of the default flow, and a count
    above the device's is refused naming both. DeepGEMM and the device are stood in for by the emulated GEMM and a
    132-SM H100."""
    from types import SimpleNamespace

    from megatron_jetrl.fp8 import backends, gemm

    calls = []
    monkeypatch.setattr(gemm, "resolve_backend", lambda name, device, n=None: "deepgemm")
    monkeypatch.setattr(backends, "self_test", lambda name, device: None)
    monkeypatch.setitem(backends.GEMMS, "deepgemm", backends.gemm_emulated)
    monkeypatch.setattr(backends, "deep_gemm_module", lambda: SimpleNamespace(__name__="deep_gemm", set_num_sms=calls.append))
    monkeypatch.setattr(backends, "SMS_IN_USE", [0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(130, 384, generator=g).to(torch.bfloat16)
    dy = torch.randn(130, 256, generator=g).to(torch.bfloat16)

    def run(flow):
        weight, inp = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y = fp8_linear(inp, weight, flow=flow)
        y.backward(dy)
        return y, inp.grad, weight.grad

    want = run(PrecisionFlow(mode="jetrl", backend="emulated"))
    assert calls == []
    got = run(PrecisionFlow(mode="jetrl", gemm_sms=120))
    assert calls == [120] and all(torch.equal(a, b) for a, b in zip(got, want))
    run(PrecisionFlow(mode="jetrl", gemm_sms=120))
    assert calls == [120]  # unchanged: no call
    run(PrecisionFlow(mode="jetrl"))
    assert calls == [120, 132] and backends.SMS_IN_USE == [0]
    with pytest.raises(ValueError, match=r"precision.gemm_sms=200, but NVIDIA H100 80GB HBM3 has 132 SMs"):
        run(PrecisionFlow(mode="jetrl", gemm_sms=200))


def test_check_finite_step_names_the_layer_and_tensor_without_a_sync_per_quantization():
    from megatron_jetrl.fp8 import finite

    flow = PrecisionFlow(mode="jetrl", check_finite="step")
    x = torch.randn(4, 128)
    x[2, 5] = float("nan")
    w = torch.randn(256, 128)
    outside = fp8_linear(x, w, flow=flow, site="decoder.layers.1.mlp.linear_fc1")  # no watch: NaN propagates as NaN
    assert outside[2].isnan().all() and not outside[[0, 1, 3]].isnan().any()
    with finite.watch() as watch:
        fp8_linear(torch.randn(4, 128), w, flow=flow, site="decoder.layers.0.mlp.linear_fc1")
        fp8_linear(x, w, flow=flow, site="decoder.layers.1.mlp.linear_fc1")
        fp8_linear(x, w, flow=flow, site="decoder.layers.2.mlp.linear_fc1")
        assert not bool(watch.finite())
        assert watch.first_problem() == (
            "decoder.layers.1.mlp.linear_fc1: input (NaN; first of 2 non-finite FP8 quantizer input(s))"
        )
        with pytest.raises(
            NonFiniteInputError, match=r"NaN/Inf reached the FP8 quantizer: decoder.layers.1.mlp.linear_fc1: input"
        ):
            watch.check()
    assert not finite.active()


def test_check_finite_step_records_output_gradients_and_weights():
    from megatron_jetrl.fp8 import finite

    flow = PrecisionFlow(mode="jetrl", check_finite="step")
    lin = FP8Linear(128, 128, bias=False, flow=flow)
    with finite.watch() as watch:
        y = lin(torch.randn(4, 128, requires_grad=True))
        assert bool(watch.finite())
        y.backward(torch.full_like(y, float("inf")))
        assert watch.first_problem().startswith("FP8Linear: output gradient (Inf;") or watch.first_problem().startswith(
            "FP8 linear [128, 128]: output gradient (Inf;"
        )
    bad = torch.randn(128, 128)
    bad[3, 4] = float("inf")
    with pytest.raises(NonFiniteInputError, match=r"got inf at index \(3, 4\)"):  # outside a step: refused on the spot
        QuantizedWeight.quantize(bad, flow)
    with finite.watch() as watch:
        QuantizedWeight.quantize(bad, flow, site="decoder.layers.0.self_attention.linear_proj")
        assert watch.first_problem().startswith("decoder.layers.0.self_attention.linear_proj: weight (Inf;")


def test_check_finite_sync_raises_at_the_quantization_and_modes_are_validated():
    x = torch.randn(4, 128)
    x[1, 7] = float("inf")
    with pytest.raises(NonFiniteInputError, match=r"got inf at index \(1, 7\)"):
        fp8_linear(x, torch.randn(128, 128), flow=PrecisionFlow(mode="jetrl", check_finite="sync"))
    assert fp8_linear(x, torch.randn(128, 128), flow=PrecisionFlow(mode="jetrl", check_finite="off"))[1].isnan().all()
    with pytest.raises(
        ValueError,
        match=r"check_finite must be one of \('step', 'sync', 'off'\), got False \(booleans are gone: "
        r"true is now 'sync', false 'off'\)",
    ):
        PrecisionFlow(check_finite=False)


@pytest.mark.parametrize("act", [torch.nn.functional.silu, torch.nn.functional.gelu])
def test_gated_input_fused_into_quantization_equals_the_unfused_mlp(act):
    """fp8_linear(gate_up, gated_act=act) == fp8_linear(act(gate) * up): output and both gradients, bit for bit
    (SiLU: the backward's own ops; other activations: autograd)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 384, generator=g).to(torch.bfloat16).requires_grad_(True)
    gate_up = torch.randn(2, 70, 768, generator=g).to(torch.bfloat16)
    dy = torch.randn(2, 70, 256, generator=g).to(torch.bfloat16)
    outs = []
    for fused in (True, False):
        x = gate_up.clone().requires_grad_(True)
        w.grad = None
        if fused:
            y = fp8_linear(x, w, flow=JETRL, gated_act=act)
        else:
            gate, up = x.chunk(2, dim=-1)
            y = fp8_linear(act(gate) * up, w, flow=JETRL)
        y.backward(dy)
        outs.append((y, x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _mlp_grads(x, w1, w2, dy, handoff, *, frozen_w1=False, x_grad=True, main_grad=False, act=torch.nn.functional.silu):
    """fc1 -> fc2(gated_act) forward and backward; the output and every gradient (fc1's in main_grad if asked)."""
    x = x.clone().requires_grad_(x_grad)
    a, b = w1.clone().requires_grad_(not frozen_w1), w2.clone().requires_grad_(True)
    if main_grad:
        a.main_grad = torch.zeros(a.shape, dtype=torch.float32)
    y = fp8_linear(fp8_linear(x, a, flow=JETRL, handoff=handoff), b, flow=JETRL, gated_act=act, handoff=handoff)
    y.backward(dy)
    return y, x.grad, a.main_grad if main_grad else a.grad, b.grad


@pytest.mark.parametrize(
    "case", [dict(), dict(frozen_w1=True), dict(x_grad=False), dict(main_grad=True), dict(act=torch.nn.functional.gelu)]
)
def test_gated_grad_handoff_gives_the_bits_of_the_unhanded_mlp(case):
    """With one GatedGradHandoff, fc2's backward quantizes d[gate | up] for fc1: output and every gradient are the
    bits of the MLP without it, whichever of fc1's operands are needed (frozen weight, input without grad)."""
    from megatron_jetrl.fp8 import GatedGradHandoff

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 136, 256, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(768, 256, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    dy = torch.randn(2, 136, 256, generator=g).to(torch.bfloat16)
    want = _mlp_grads(x, w1, w2, dy, None, **case)
    handoff = GatedGradHandoff()
    got = _mlp_grads(x, w1, w2, dy, handoff, **case)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(
                a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32),
            )
    assert handoff._grads is None and handoff._token is None  # taken, nothing kept alive


def test_gated_grad_handoff_refuses_a_changed_gradient_and_a_biased_up_projection():
    from megatron_jetrl.fp8 import GatedGradHandoff

    x = torch.randn(8, 128, requires_grad=True)
    w1, w2 = torch.randn(256, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)
    h = GatedGradHandoff()
    gate_up = fp8_linear(x, w1, flow=JETRL, handoff=h)
    y = fp8_linear(gate_up * 2, w2, flow=JETRL, gated_act=torch.nn.functional.silu, handoff=h)  # an op in between
    with pytest.raises(RuntimeError, match=r"received a gradient other than the down projection's FP8 handoff"):
        y.sum().backward()
    with pytest.raises(ValueError, match=r"needs a bias-free up projection .* pass handoff=None"):
        fp8_linear(x, w1, torch.zeros(256), flow=JETRL, handoff=GatedGradHandoff())


def test_bias_only_gradient_quantizes_nothing():
    """A frozen weight, an input without grad: backward gives the bias gradient only (dY is not quantized)."""
    from megatron_jetrl.fp8 import finite

    lin = FP8Linear(128, 256, flow=JETRL)
    lin.weight.requires_grad_(False)
    x = torch.randn(5, 128)
    dy = torch.randn(5, 256)
    with finite.watch() as watch:
        lin(x).backward(dy)
        assert not any(site.endswith("output gradient") for site in watch._sites)
    assert torch.allclose(lin.bias.grad, dy.sum(0)) and lin.weight.grad is None


def test_finite_watch_reduces_in_chunks_and_names_the_first_bad_site(monkeypatch):
    """Records are reduced CHUNK at a time (no launch per quantization): the first NaN/Inf site is still named
    exactly, wherever it falls against a chunk boundary, for transposed-view scales too; LIMIT self-checks."""
    from megatron_jetrl.fp8 import finite

    monkeypatch.setattr(finite.FiniteWatch, "CHUNK", 4)
    for bad_at, value in ((0, float("nan")), (3, float("inf")), (4, float("-inf")), (9, float("nan"))):
        w = finite.FiniteWatch()
        for i in range(11):
            s = torch.rand(3, 2).t()  # a (1, M)-strided view, as the quantizers write 1x128 scales
            if i == bad_at:
                s[1, 2] = value
            if i == bad_at + 1:
                s[0, 0] = float("inf")
            w.record(f"site{i}", s)
        assert len(w._pending) == 11 % 4 and len(w._sums) == 8
        assert not bool(w.finite())
        kind = "NaN" if value != value else "Inf"
        assert w.first_problem() == f"site{bad_at} ({kind}; first of 2 non-finite FP8 quantizer input(s))"
    w = finite.FiniteWatch()
    w.record("big", torch.full((8, 4), 1.0e36))  # finite, large: the FP32 sum of |s| stays finite
    w.record("empty", torch.empty(0, 4))
    assert bool(w.finite()) and w.first_problem() is None and w._sites == ["big"]
    monkeypatch.setattr(finite.FiniteWatch, "LIMIT", 8)
    w = finite.FiniteWatch()
    for i in range(20):
        w.record(f"s{i}", torch.full((2,), float("nan") if i == 5 else 1.0))
    assert w.first_problem() == "s5 (NaN; first of 1 non-finite FP8 quantizer input(s))"
    assert w._sites == [] and w._pending == []  # stopped recording once the limit found a problem


def test_a_watch_summary_is_one_scalar_that_is_non_finite_exactly_when_a_record_was(monkeypatch):
    """What a CUDA graph keeps of the quantizations it captured (`actor.layer_graphs`): one FP32 scalar, NaN or Inf
    exactly when one of them was, across chunk boundaries; None with nothing recorded; as a record it names its site."""
    from megatron_jetrl.fp8 import finite

    monkeypatch.setattr(finite.FiniteWatch, "CHUNK", 4)
    assert finite.FiniteWatch().summary() is None
    for bad_at, value in ((None, 0.0), (0, float("nan")), (5, float("inf")), (9, float("-inf"))):
        w = finite.FiniteWatch()
        for i in range(10):
            s = torch.rand(3, 2).t()
            if i == bad_at:
                s[0, 1] = value
            w.record(f"site{i}", s)
        total = w.summary()
        assert total.shape == () and total.dtype == torch.float32
        assert bool(torch.isfinite(total)) == (bad_at is None)
        step = finite.FiniteWatch()
        step.record("decoder.layers.2 (CUDA graph, backward)", total.clone())
        want = None if bad_at is None else "decoder.layers.2 (CUDA graph, backward) ("
        assert step.first_problem() == want or step.first_problem().startswith(want)
