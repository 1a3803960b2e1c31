"""GRPO advantages and the clipped policy loss against FP64 references written here, token by token."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.grpo.advantages import group_advantages
from megatron_jetrl.grpo.loss import AGGREGATIONS, KL_ESTIMATORS, PolicyLossConfig, check_mask, policy_loss

HYP = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------------------------------------
# advantages


def reference_advantages(rewards: list[float], n: int, scale: str, eps: float) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if scale == "std" else r - mean)
    return out


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, eps=0.0)
    # group 0: 1 of 4 correct -> +sqrt(3), -1/sqrt(3); group 1 constant -> 0; group 2: 2 of 4 -> +-1
    s3 = math.sqrt(3)
    expected = [s3, -1 / s3, -1 / s3, -1 / s3, 0, 0, 0, 0, -1, 1, -1, 1]
    assert adv.tolist() == pytest.approx(expected, abs=1e-15)
    none = group_advantages(rewards, 4, scale="none")
    assert none.tolist() == [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0.5, -0.5, 0.5]


@HYP
@given(st.integers(2, 6), st.integers(1, 5), st.data(), st.sampled_from(["std", "none"]), st.sampled_from([0.0, 1e-6, 0.5]))
def test_advantages_match_fp64_reference(n, prompts, data, scale, eps):
    values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-10, 10, allow_nan=False))
    rewards = data.draw(st.lists(values, min_size=n * prompts, max_size=n * prompts))
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), n, scale=scale, eps=eps).tolist()
    want = reference_advantages(rewards, n, scale, eps)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-9)


@HYP
@given(st.floats(-1e6, 1e6, allow_nan=False), st.integers(2, 16), st.sampled_from(["std", "none"]))
def test_constant_group_gives_exact_zero(value, n, scale):
    rewards = torch.tensor([value] * n + [0.0, 1.0] * (n // 2) + [1.0] * (n % 2), dtype=torch.float32)
    adv = group_advantages(rewards, n, scale=scale)
    assert torch.equal(adv[:n], torch.zeros(n))  # bitwise: +0.0, no 0/eps residue


@pytest.mark.parametrize("spread", [2.369844591834898e-233, 1e-160, 1e160])
def test_std_advantages_survive_tiny_and_huge_spreads(spread):
    # a found case: squaring a spread of 1e-233 underflowed, std became 0 and the z-scores +-inf
    adv = group_advantages(torch.tensor([0.0, spread], dtype=torch.float64), 2, eps=0.0)
    assert adv.tolist() == pytest.approx([-1.0, 1.0], rel=1e-12)


def test_advantage_dtypes():
    assert group_advantages(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([True, False]), 2).tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), 2).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "rewards,n,kw,match",
    [
        (torch.zeros(2, 4), 4, {}, "1-D"),
        (torch.zeros(6), 4, {}, "groups of n=4"),
        (torch.zeros(0), 2, {}, "groups of n=2"),
        (torch.zeros(4), 1, {}, ">= 2"),
        (torch.zeros(4), 2, {"scale": "mad"}, "unknown advantage scale"),
        (torch.zeros(4), 2, {"eps": -1.0}, "eps"),
    ],
)
def test_advantage_bad_input(rewards, n, kw, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, n, **kw)


# ---------------------------------------------------------------------------------------------------------
# policy loss: an independent FP64 reference, one token at a time


def reference_loss(lp, old, adv, mask, cfg, ref=None, roll=None):
    """(loss, pg, kl, clip_frac, ratio_mean, tis_mean, tis_clip) in Python floats, straight from the formulas."""
    lp, old, mask = lp.tolist(), old.tolist(), mask.tolist()
    ref = ref.tolist() if ref is not None else None
    roll = roll.tolist() if roll is not None else None
    pg_seq, kl_seq, counts = [], [], []
    clipped = ratios = tis_w = tis_hit = tokens = 0
    for b in range(len(lp)):
        pg_sum = kl_sum = 0.0
        count = 0
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = float(adv[b])
            low, high = 1 - cfg.clip_low, 1 + cfg.clip_high
            term1, term2 = -a * r, -a * min(max(r, low), high)
            pg = max(term1, term2)
            clipped += term2 > term1
            ratios += r
            if cfg.tis_cap is not None:
                raw = math.exp(old[b][t] - roll[b][t])
                w = min(raw, cfg.tis_cap)
                pg *= w
                tis_w += w
                tis_hit += raw > cfg.tis_cap
            if ref is not None and cfg.kl_estimator != "none":
                d = lp[b][t] - ref[b][t]
                kl_sum += {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[cfg.kl_estimator]
            pg_sum += pg
            count += 1
        pg_seq.append(pg_sum)
        kl_seq.append(kl_sum)
        counts.append(count)
        tokens += count

    def agg(per_seq):
        if cfg.agg == "token-mean":
            return sum(per_seq) / tokens
        if cfg.agg == "seq-mean-token-mean":
            return sum(s / c for s, c in zip(per_seq, counts)) / len(per_seq)
        return sum(per_seq) / len(per_seq)

    pg, kl = agg(pg_seq), agg(kl_seq)
    loss = pg + (cfg.kl_coef * kl if cfg.uses_kl else 0.0)
    return {
        "loss": loss,
        "pg_loss": pg,
        "kl": kl,
        "clip_frac": clipped / tokens,
        "ratio_mean": ratios / tokens,
        "tis_weight_mean": tis_w / tokens,
        "tis_clip_frac": tis_hit / tokens,
    }


def make_batch(seed, b=3, t=7, dtype=torch.float64, spread=0.4, every_row=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    old = lp + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = lp + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    roll = old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    if every_row:
        mask[:, 0] = True
    return [x.to(dtype) if x.is_floating_point() else x for x in (lp, old, adv, mask, ref, roll)]


CONFIGS = [
    PolicyLossConfig(agg=agg, kl_estimator=kl, tis_cap=cap, kl_coef=0.1)
    for agg in AGGREGATIONS
    for kl in KL_ESTIMATORS
    for cap in (None, 1.3)
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.agg}-{c.kl_estimator}-tis{c.tis_cap}")
def test_matches_fp64_reference(cfg):
    for seed in range(4):
        lp, old, adv, mask, ref, roll = make_batch(seed)
        loss, m = policy_loss(lp, old, adv, mask, cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)
        want = reference_loss(lp, old, adv, mask, cfg, ref, roll)
        assert loss.item() == pytest.approx(want["loss"], rel=1e-12, abs=1e-14)
        for key in ("pg_loss", "clip_frac", "ratio_mean"):
            assert m[key].item() == pytest.approx(want[key], rel=1e-12, abs=1e-14), key
        assert ("kl" in m) == (cfg.kl_estimator != "none")
        if "kl" in m:
            assert m["kl"].item() == pytest.approx(want["kl"], rel=1e-12, abs=1e-14)
        assert ("tis_weight_mean" in m) == (cfg.tis_cap is not None) == ("tis_clip_frac" in m)
        if cfg.tis_cap is not None:
            assert m["tis_weight_mean"].item() == pytest.approx(want["tis_weight_mean"], rel=1e-12)
            assert m["tis_clip_frac"].item() == pytest.approx(want["tis_clip_frac"], rel=1e-12)
        assert 0 < m["clip_frac"].item() < 1  # spread 0.4 puts tokens on both sides of the clip range


def test_fp32_inputs_stay_within_fp32_error_of_the_reference():
    cfg = PolicyLossConfig(kl_coef=0.1, tis_cap=1.5)
    lp, old, adv, mask, ref, roll = make_batch(7, b=8, t=64)
    want = reference_loss(lp, old, adv, mask, cfg, ref, roll)["loss"]
    f32 = [x.float() if x.is_floating_point() else x for x in (lp, old, adv, mask, ref, roll)]
    loss, _ = policy_loss(*f32[:4], cfg=cfg, ref_logprobs=f32[4], rollout_logprobs=f32[5])
    assert loss.dtype == torch.float32
    assert abs(loss.item() - want) <= 1e-5 * max(1.0, abs(want))


def test_hand_computed_clipping():
    cfg = PolicyLossConfig(kl_estimator="none")  # clip range [0.8, 1.28]
    lp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.1]], dtype=torch.float64)).repeat(2, 1).requires_grad_()
    old = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = policy_loss(lp, old, adv, mask, cfg=cfg)
    # row 0, A=+1: r=1.5 clipped to 1.28 (-1.28, no gradient); r=1.1 inside (-1.1, gradient -r/N)
    # row 1, A=-1: r=0.5 clipped below: max(0.5, 0.8) = 0.8 (no gradient), twice
    assert loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 0.8) / 4, abs=1e-15)
    assert m["clip_frac"].item() == 0.75
    loss.backward()
    expected = torch.zeros(2, 4, dtype=torch.float64)
    expected[0, 3] = -1.1 / 4
    assert torch.allclose(lp.grad, expected, atol=1e-15)


def test_negative_advantage_below_clip_keeps_gradient_positive_advantage_low_ratio_too():
    cfg = PolicyLossConfig(kl_estimator="none")
    # A=+1 with r=0.5 < 0.8 and A=-1 with r=1.5 > 1.28: the unclipped term is the max, gradient flows
    lp = torch.log(torch.tensor([[0.5], [1.5]], dtype=torch.float64)).requires_grad_()
    loss, m = policy_loss(
        lp, torch.zeros(2, 1, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 1), cfg=cfg
    )
    assert loss.item() == pytest.approx((-0.5 + 1.5) / 2, abs=1e-15)
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.5 / 2, 1.5 / 2], abs=1e-15)


@pytest.mark.parametrize(
    "cfg", [CONFIGS[i] for i in (0, 5, 11, 14, 23)], ids=lambda c: f"{c.agg}-{c.kl_estimator}-tis{c.tis_cap}"
)
def test_gradient_matches_finite_differences(cfg):
    lp, old, adv, mask, ref, roll = make_batch(3, b=3, t=5)
    f = lambda x: policy_loss(x, old, adv, mask, cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)[0]
    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_analytic_gradient_inside_the_clip_range():
    cfg = PolicyLossConfig(kl_coef=0.05, kl_estimator="k3", tis_cap=1.2)
    lp, old, adv, mask, ref, roll = make_batch(11, spread=0.05)
    lp.requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    r = torch.exp(lp.detach() - old)
    w = torch.exp(old - roll).clamp(max=1.2)
    d = lp.detach() - ref
    n = mask.sum()
    # d/dlp of -A r w is -A r w; of k3 = exp(-d) - 1 + d is 1 - exp(-d)
    want = torch.where(mask, (-adv[:, None] * r * w + 0.05 * (1 - torch.exp(-d))) / n, 0.0)
    assert torch.allclose(lp.grad, want, rtol=1e-12, atol=1e-15)


def test_only_logprobs_receive_gradient():
    lp, old, adv, mask, ref, roll = make_batch(5)
    others = [t.clone().requires_grad_() for t in (old, adv, ref, roll)]
    lp.requires_grad_()
    loss, metrics = policy_loss(
        lp, others[0], others[1], mask, cfg=PolicyLossConfig(tis_cap=2.0), ref_logprobs=others[2], rollout_logprobs=others[3]
    )
    loss.backward()
    assert lp.grad is not None and all(t.grad is None for t in others)
    assert all(not v.requires_grad for v in metrics.values())


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    lp, old, adv, mask, ref, roll = make_batch(seed, b, t, spread=draw(st.sampled_from([0.0, 0.1, 1.0])))
    return lp, old, adv, mask, ref, roll


@HYP
@given(batches(), st.sampled_from(AGGREGATIONS))
def test_ratio_one_gives_minus_mean_advantage(batch, agg):
    lp, _, adv, mask, _, _ = batch
    loss, m = policy_loss(lp, lp.clone(), adv, mask, cfg=PolicyLossConfig(agg=agg, kl_estimator="none"))
    counts = mask.sum(dim=1).double()
    want = {
        "token-mean": -(adv * counts).sum() / counts.sum(),
        "seq-mean-token-mean": -adv.mean(),
        "seq-mean-token-sum": -(adv * counts).mean(),
    }[agg]
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    assert m["ratio_mean"].item() == 1.0 and m["clip_frac"].item() == 0.0


@HYP
@given(batches(), st.sampled_from(CONFIGS), st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -7.0]))
def test_values_under_mask_zero_change_nothing(batch, cfg, garbage):
    lp, old, adv, mask, ref, roll = batch
    lp1 = lp.clone().requires_grad_()
    loss1, m1 = policy_loss(lp1, old, adv, mask, cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)
    loss1.backward()
    junk = lambda x: torch.where(mask, x, garbage)
    lp2 = junk(lp).requires_grad_()
    adv2 = torch.where(mask.any(dim=1), adv, garbage)
    loss2, m2 = policy_loss(lp2, junk(old), adv2, mask, cfg=cfg, ref_logprobs=junk(ref), rollout_logprobs=junk(roll))
    loss2.backward()
    assert torch.equal(loss1, loss2)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert torch.equal(lp1.grad, lp2.grad)
    assert torch.equal(lp2.grad[~mask], torch.zeros_like(lp2.grad[~mask]))


@HYP
@given(batches(), st.floats(0.01, 3.0), st.floats(0.0, 0.9), st.floats(0.0, 2.0))
def test_fractions_are_fractions(batch, cap, clip_low, clip_high):
    lp, old, adv, mask, ref, roll = batch
    cfg = PolicyLossConfig(clip_low=clip_low, clip_high=clip_high, tis_cap=cap)
    _, m = policy_loss(lp, old, adv, mask, cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)
    for key in ("clip_frac", "tis_clip_frac"):
        assert 0.0 <= m[key].item() <= 1.0
    assert 0.0 < m["tis_weight_mean"].item() <= cap * (1 + 1e-12)


def test_tis_with_identical_rollout_is_a_no_op():
    lp, old, adv, mask, ref, _ = make_batch(2)
    base, _ = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(), ref_logprobs=ref)
    tis, m = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(tis_cap=2.0), ref_logprobs=ref, rollout_logprobs=old)
    assert torch.equal(base, tis)
    assert m["tis_weight_mean"].item() == 1.0 and m["tis_clip_frac"].item() == 0.0


def test_kl_at_reference_is_zero_and_k3_is_nonnegative():
    lp, old, adv, mask, ref, _ = make_batch(4, spread=1.0)
    for est in ("k1", "k2", "k3"):
        _, m = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(kl_estimator=est), ref_logprobs=lp.clone())
        assert m["kl"].item() == 0.0
    _, m = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(kl_estimator="k3"), ref_logprobs=ref)
    assert m["kl"].item() > 0


def test_kl_coef_zero_reports_kl_but_leaves_loss_alone():
    lp, old, adv, mask, ref, _ = make_batch(6)
    loss, m = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(kl_coef=0.0), ref_logprobs=ref)
    assert torch.equal(loss, m["pg_loss"]) and "kl" in m
    loss, m = policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(kl_coef=0.0))  # no reference needed
    assert "kl" not in m


@pytest.mark.parametrize(
    "kw",
    [
        dict(clip_low=1.0),
        dict(clip_low=-0.1),
        dict(clip_high=-0.1),
        dict(kl_coef=-1.0),
        dict(kl_estimator="k4"),
        dict(agg="mean"),
        dict(tis_cap=0.0),
    ],
)
def test_config_validation(kw):
    with pytest.raises(ValueError, match="invalid PolicyLossConfig: " + next(iter(kw))):
        PolicyLossConfig(**kw)


def test_bad_inputs_are_named():
    lp, old, adv, mask, ref, roll = make_batch(1)
    cfg = PolicyLossConfig()
    cases = [
        (dict(logprobs=lp[0]), "logprobs must be \\[B, T\\]"),
        (dict(old_logprobs=old[:, :-1]), "old_logprobs has shape"),
        (dict(mask=mask[:-1]), "mask has shape"),
        (dict(ref_logprobs=ref.T), "ref_logprobs has shape"),
        (dict(advantages=adv[:, None]), "advantages must be \\[B\\]"),
        (dict(ref_logprobs=None), "needs ref_logprobs"),
        (dict(mask=torch.zeros_like(mask)), "mask selects no token"),
        (dict(mask=mask.double() * 2), "only 0 and 1"),
        (dict(logprobs=lp.long()), "logprobs must be a floating tensor"),
    ]
    base = dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref)
    for change, match in cases:
        args = {**base, **change}
        with pytest.raises(ValueError, match=match):
            policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"), args.pop("mask"), cfg=cfg, **args)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        policy_loss(lp, old, adv, mask, cfg=PolicyLossConfig(tis_cap=2.0), ref_logprobs=ref)
    empty_row = mask.clone()
    empty_row[1] = False
    with pytest.raises(ValueError, match=r"sequences \[1\] have no response token"):
        policy_loss(lp, old, adv, empty_row, cfg=PolicyLossConfig(agg="seq-mean-token-mean"), ref_logprobs=ref)
    loss, _ = policy_loss(lp, old, adv, empty_row, cfg=cfg, ref_logprobs=ref)  # token-mean skips the empty row
    assert torch.isfinite(loss)


def test_checked_policy_loss_never_reads_a_tensor_on_the_host(monkeypatch):
    """The trainer checks the mask once per step (check_mask); each micro-batch's loss then runs without a host
    sync, which would drain the GPU queue between forward and backward. Same loss as the unchecked call."""
    lp, old, adv, mask, ref, roll = make_batch(5)
    for cfg in CONFIGS:
        want, want_m = policy_loss(lp, old, adv, mask.double(), cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll)
        with monkeypatch.context() as m:
            for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
                m.setattr(torch.Tensor, name, lambda *a, _n=name: pytest.fail(f"host sync: Tensor.{_n}"))
            got, got_m = policy_loss(lp, old, adv, mask.double(), cfg=cfg, ref_logprobs=ref, rollout_logprobs=roll, checked=True)
        assert torch.equal(got, want) and all(torch.equal(got_m[k], v) for k, v in want_m.items())


def test_check_mask_once_for_a_batch_names_the_bad_rows_and_micro_batches():
    mask = torch.ones(6, 5)
    check_mask(mask, "seq-mean-token-mean", rows_per_loss=2)
    mask[2:4] = 0  # micro-batch 1 (rows 2, 3) has no response token
    with pytest.raises(ValueError, match=r"sequences \[2, 3\] have no response token"):
        check_mask(mask, "seq-mean-token-sum", rows_per_loss=2)
    with pytest.raises(ValueError, match=r"mask selects no token in micro-batches \[1\]"):
        check_mask(mask, "token-mean", rows_per_loss=2)
    check_mask(mask, "token-mean", rows_per_loss=3)  # rows 0-2 and 3-5 each have tokens
    check_mask(mask, "token-mean")  # one loss over all rows
    with pytest.raises(ValueError, match="only 0 and 1"):
        check_mask(mask * 0.5, "token-mean")
    with pytest.raises(ValueError, match="rows_per_loss=4: pass the micro-batch size"):
        check_mask(mask, "token-mean", rows_per_loss=4)
