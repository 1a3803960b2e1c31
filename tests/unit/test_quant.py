"""Quantizer contract: bytes and scales equal to an independent reference; shapes, errors, TP shards."""

import math

import fp8_reference as ref
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_jetrl.fp8 import (
    BLOCKS,
    NonFiniteInputError,
    check_shard_alignment,
    dequantize_blockwise,
    quantize_blockwise,
    scale_shape,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_matches_reference(x, block, scale_mode):
    q, s = quantize_blockwise(x, block, scale_mode)
    ref_q, ref_s = ref.quantize(x, block, scale_mode)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(x.shape, block)
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32)), "scales differ from the reference"
    diff = (q.view(torch.uint8) != ref_q).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


# Values a quantizer gets wrong first: zeros, subnormals, exact powers of two, numbers at and beyond
# 448, halfway points of the E4M3 grid, mixed signs, and magnitudes at the ends of each input dtype.
special = st.sampled_from(
    [
        0.0,
        -0.0,
        1e-45,
        -1e-40,
        1e-12,
        2.0**-9,
        2.0**-6,
        1.0,
        1.0625,
        1.125,
        -3.5,
        447.0,
        448.0,
        449.0,
        464.0,
        480.0,
        1e4,
        6.5e4,
        -6.5e4,
        1e30,
        -3e38,
        0.1,
        -0.3,
    ]
)
value = st.one_of(special, st.floats(-1e3, 1e3, allow_nan=False, width=32))


@st.composite
def tensors(draw, max_rows=260, max_cols=260):
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    kind = draw(st.sampled_from(["normal", "special", "scaled"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(rows, cols, generator=g) * draw(st.sampled_from([1e-8, 1e-3, 1.0, 30.0, 1e4]))
    elif kind == "scaled":  # outliers: one huge value per row among small ones
        x = torch.randn(rows, cols, generator=g)
        x[:, 0] = draw(st.sampled_from([448.0, 1e5, 1e-3]))
    else:
        vals = draw(st.lists(value, min_size=1, max_size=64))
        idx = torch.randint(len(vals), (rows, cols), generator=g)
        x = torch.tensor(vals, dtype=torch.float32)[idx]
    if dtype != torch.float32:
        finfo = torch.finfo(dtype)
        x = x.clamp(-finfo.max, finfo.max)
    return x.to(dtype)


@SETTINGS
@given(x=tensors(), block=st.sampled_from(BLOCKS), scale_mode=st.sampled_from(["fp32", "ue8m0"]))
def test_bytes_equal_reference(x, block, scale_mode):
    assert_matches_reference(x, block, scale_mode)


@pytest.mark.parametrize("scale_mode", ["fp32", "ue8m0"])
@pytest.mark.parametrize("block", BLOCKS)
def test_partial_blocks_and_dtypes(block, scale_mode):
    for dtype in DTYPES:
        x = (torch.randn(131, 257) * 5).to(dtype)
        assert_matches_reference(x, block, scale_mode)


def test_all_zero_group_gives_zero_bytes_and_finite_scale():
    x = torch.zeros(2, 256)
    x[1, 128:] = torch.randn(128)
    q, s = quantize_blockwise(x, (1, 128))
    assert q.view(torch.uint8)[0].eq(0).all() and q.view(torch.uint8)[1, :128].eq(0).all()
    assert torch.isfinite(s).all() and s[0, 0] == np.float32(1e-10) / np.float32(448)


def test_tie_rounds_to_even_and_values_saturate_only_by_clamp():
    # A group whose amax is 448 has s == 1: x / s == x, so grid midpoints must round to even.
    x = torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 19.0, -0.0, 400.0, 432.0]])
    q, s = quantize_blockwise(x, (1, 128))
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 16.0, 20.0, -0.0, 384.0, 448.0]]


def test_ue8m0_scales_are_powers_of_two_at_least_the_fp32_scale():
    x = torch.randn(64, 1024) * torch.logspace(-6, 6, 64)[:, None]
    _, s32 = quantize_blockwise(x, (1, 128), "fp32")
    _, s2 = quantize_blockwise(x, (1, 128), "ue8m0")
    mant, _ = np.frexp(s2.numpy())
    assert np.all(mant == 0.5), "ue8m0 scales must be exact powers of two"
    assert torch.all(s2 >= s32) and torch.all(s2 < 2 * s32)


def test_ue8m0_exact_when_scale_is_just_above_a_power_of_two():
    # amax = 448 * 2**-10 * (1 + 2**-23): log2 of the scale rounds to -10 in FP32, the exact answer is 2**-9.
    s_exact = np.float32(2.0**-10) * np.float32(1 + 2.0**-23)
    amax = np.float32(s_exact * np.float32(448))
    x = torch.tensor([[float(amax), 0.5]], dtype=torch.float32)
    _, s = quantize_blockwise(x, (1, 128), "ue8m0")
    raw = np.float32(amax) / np.float32(448)
    assert s.item() == (2.0**-9 if raw > 2.0**-10 else 2.0**-10)
    assert_matches_reference(x, (1, 128), "ue8m0")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("block", BLOCKS)
def test_non_finite_input_is_an_error_that_names_the_element(bad, block):
    x = torch.randn(130, 300, dtype=torch.bfloat16)
    x[129, 257] = bad
    with pytest.raises(NonFiniteInputError, match=r"at index \(129, 257\)"):
        quantize_blockwise(x, block)


def test_non_finite_with_check_off_propagates_nan_not_448():
    x = torch.ones(1, 128)
    x[0, 3] = float("inf")
    q, s = quantize_blockwise(x, (1, 128), check_finite=False)
    assert not torch.isfinite(s).all() and torch.isnan(q.float()).any()
    assert not (q.float() == 448).any()


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="block must be one of"):
        quantize_blockwise(torch.randn(4, 128), (1, 64))
    with pytest.raises(TypeError, match="cast explicitly"):
        quantize_blockwise(torch.randn(4, 128, dtype=torch.float64), (1, 128))
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_blockwise(torch.randn(4, 128), (1, 128), "e8m0")
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_blockwise(torch.randn(128), (128, 128))
    q, s = quantize_blockwise(torch.randn(4, 256), (1, 128))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_blockwise(q, s[:, :1], (1, 128))


def test_leading_batch_dims_and_1d():
    x = torch.randn(3, 5, 300)
    q, s = quantize_blockwise(x, (1, 128))
    q2, s2 = quantize_blockwise(x.reshape(15, 300), (1, 128))
    assert torch.equal(q.view(torch.uint8).reshape(15, 300), q2.view(torch.uint8)) and torch.equal(s.reshape(15, 3), s2)
    q1, s1 = quantize_blockwise(x[0, 0], (1, 128))
    assert s1.shape == (3,) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)[0])
    qb, sb = quantize_blockwise(x, (128, 128))
    assert sb.shape == (3, 1, 3)
    for i in range(3):
        qi, si = quantize_blockwise(x[i], (128, 128))
        assert torch.equal(qb[i].view(torch.uint8), qi.view(torch.uint8)) and torch.equal(sb[i], si)


@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_is_q_times_s_per_block(block):
    x = torch.randn(200, 333, dtype=torch.bfloat16) * 7
    q, s = quantize_blockwise(x, block)
    deq = dequantize_blockwise(q, s, block)
    bm, bk = block
    for i in (0, 127, 128, 199):
        for j in (0, 127, 128, 332):
            assert deq[i, j] == q[i, j].float() * s[i // bm, j // bk]
    # Quantization error bound: RNE to 3 mantissa bits is within 2**-4 relative for normal E4M3 values,
    # and within half the subnormal spacing (2**-10 * s) below that.
    s_full = s.repeat_interleave(bm, 0)[:200].repeat_interleave(bk, 1)[:, :333]
    err = (deq - x.float()).abs()
    assert torch.all(err <= x.float().abs() * 2.0**-4 + s_full * 2.0**-10)


@given(
    rows_blocks=st.integers(1, 4),
    cols_blocks=st.integers(1, 4),
    parts=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([0, 1]),
    scale_mode=st.sampled_from(["fp32", "ue8m0"]),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=40, deadline=None)
def test_tp_shard_invariance(rows_blocks, cols_blocks, parts, dim, scale_mode, seed):
    n_blocks = (rows_blocks, cols_blocks)[dim]
    if n_blocks % parts:
        return
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows_blocks * 128, cols_blocks * 128, generator=g) * 0.02).to(torch.bfloat16)
    q, s = quantize_blockwise(w, (128, 128), scale_mode)
    check_shard_alignment(w.shape[dim], parts, what="test weight")
    for shard, q_part, s_part in zip(w.chunk(parts, dim), q.chunk(parts, dim), s.chunk(parts, dim)):
        q_shard, s_shard = quantize_blockwise(shard, (128, 128), scale_mode)
        assert torch.equal(q_shard.view(torch.uint8), q_part.view(torch.uint8))
        assert torch.equal(s_shard, s_part)


def test_misaligned_shards_are_refused_naming_the_dimension():
    with pytest.raises(ValueError, match=r"layers.0.mlp.fc2 input dim.*896 split 4 ways.*\[1\]"):
        check_shard_alignment(896, 4, what="layers.0.mlp.fc2 input dim")
    with pytest.raises(ValueError, match="no TP size keeps whole blocks"):
        check_shard_alignment(200, 2, what="q_proj output dim")
    # and the refusal is real: a 64-wide cut changes the blocks (the block's amax sits in the cut-off half)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    w[5, 200] = 10.0
    q, s = quantize_blockwise(w, (128, 128))
    q_half, _ = quantize_blockwise(w[:, :192], (128, 128))
    assert not torch.equal(q_half.view(torch.uint8)[:, 128:], q.view(torch.uint8)[:, 128:192])
    assert math.isfinite(float(s.sum()))
