"""Train/rollout mismatch metrics against hand-computed values."""

import math

import pytest
import torch

from megatron_jetrl.rollout.metrics import flat_metrics, length_means, mismatch_metrics


def test_identical_logprobs_sit_at_zero():
    lp = [[-0.5, -1.0, -2.0], [-0.1]]
    m = mismatch_metrics(lp, lp)
    assert m["tokens"] == 4
    assert m["mean_abs_diff"] == 0 and m["k3_kl"] == 0 and m["exp_abs_diff"] == 1
    assert m["ratio_mean"] == 1 and m["ratio_clip_frac"] == 0 and m["tis_weight_mean"] == 1 and m["tis_weight_std"] == 0


def test_hand_computed_values():
    train = [[0.0, -1.0], [-2.0]]
    rollout = [[-1.0, -1.0], [-1.0]]  # d = [1, 0, -1]
    m = mismatch_metrics(train, rollout, tis_cap=2.0)
    e = math.e
    assert m["mean_abs_diff"] == pytest.approx(2 / 3)
    assert m["max_abs_diff"] == pytest.approx(1.0)
    # k3 = (r - 1) - log r with r = e^d
    assert m["k3_kl"] == pytest.approx(((e - 1 - 1) + 0 + (1 / e - 1 + 1)) / 3)
    assert m["exp_abs_diff"] == pytest.approx((e + 1 + e) / 3)
    assert m["ratio_mean"] == pytest.approx((e + 1 + 1 / e) / 3)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(1 / e), pytest.approx(e))
    assert m["ratio_clip_frac"] == pytest.approx(1 / 3)  # e > 2
    assert m["tis_weight_mean"] == pytest.approx((2 + 1 + 1 / e) / 3)
    w = [2.0, 1.0, 1 / e]  # min(r, cap): the TIS weights' spread, population standard deviation over tokens
    mean = sum(w) / 3
    assert m["tis_weight_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in w) / 3), rel=1e-12)


def test_padded_tensors_with_mask_and_position_buckets():
    train = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 9.0]])
    rollout = torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    m = mismatch_metrics(train, rollout, mask, position_edges=(0, 1, 3))
    assert m["tokens"] == 6
    assert m["mean_abs_diff"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 0.5 + 0.6) / 6)
    buckets = {(b["start"], b["end"]): b for b in m["by_position"]}
    assert buckets[(0, 1)]["tokens"] == 2 and buckets[(0, 1)]["mean_abs_diff"] == pytest.approx(0.3)
    assert buckets[(1, 3)]["tokens"] == 3 and buckets[(1, 3)]["mean_abs_diff"] == pytest.approx((0.2 + 0.3 + 0.6) / 3)
    assert buckets[(3, None)]["tokens"] == 1 and buckets[(3, None)]["mean_abs_diff"] == pytest.approx(0.4)
    flat = flat_metrics(m)
    assert flat["mismatch/pos3-inf/tokens"] == 1 and "mismatch/k3_kl" in flat


def test_layout_mismatch_is_refused():
    with pytest.raises(ValueError, match="disagree in layout"):
        mismatch_metrics([[0.0, 1.0]], [[0.0]])
    with pytest.raises(ValueError, match="position_edges"):
        mismatch_metrics([[0.0]], [[0.0]], position_edges=(5, 1))


def test_length_buckets_pool_whole_responses_by_length():
    # lengths 1, 3, 2, 5 -> buckets [1, 2): row 0; [2, 4): rows 1 and 2; [4, 8): row 3
    train = [[0.0], [0.0, 0.0, 0.0], [0.0, 0.0], [0.0] * 5]
    rollout = [[-0.1], [-0.2, -1.5, 0.3], [0.4, -0.5], [-2.0, 0.0, 0.0, 0.0, 0.0]]
    m = mismatch_metrics(train, rollout)
    assert m["abs_diff_gt1_frac"] == pytest.approx(2 / 11)
    b = {(x["start"], x["end"]): x for x in m["by_length"]}
    assert sorted(b) == [(1, 2), (2, 4), (4, 8)]
    assert b[(1, 2)] == {
        "start": 1,
        "end": 2,
        "tokens": 1,
        "responses": 1,
        "mean_abs_diff": pytest.approx(0.1),
        "k3_kl": pytest.approx(math.exp(0.1) - 1 - 0.1),
        "max_abs_diff": pytest.approx(0.1),
        "abs_diff_gt1_frac": 0.0,
        "seq_abs_log_ratio": pytest.approx(0.1),
    }
    # log ratios of rows 1 and 2: 0.2 + 1.5 - 0.3 = 1.4 and -0.4 + 0.5 = 0.1
    assert b[(2, 4)]["seq_abs_log_ratio"] == pytest.approx((1.4 + 0.1) / 2)
    assert (b[(2, 4)]["tokens"], b[(2, 4)]["responses"]) == (5, 2)
    assert b[(2, 4)]["mean_abs_diff"] == pytest.approx((0.2 + 1.5 + 0.3 + 0.4 + 0.5) / 5)
    assert b[(2, 4)]["max_abs_diff"] == pytest.approx(1.5) and b[(2, 4)]["abs_diff_gt1_frac"] == pytest.approx(1 / 5)
    assert b[(4, 8)]["mean_abs_diff"] == pytest.approx(0.4) and b[(4, 8)]["abs_diff_gt1_frac"] == pytest.approx(1 / 5)
    flat = flat_metrics(m)
    assert flat["mismatch/len2-4/responses"] == 2 and flat["mismatch/len4-8/max_abs_diff"] == pytest.approx(2.0)
    assert "mismatch/len8-16/tokens" not in flat  # empty buckets are left out, not logged as 0


def test_length_buckets_of_a_padded_batch_use_the_mask():
    train = torch.zeros(2, 4)
    rollout = torch.tensor([[-0.1, -0.1, 0.0, 0.0], [-0.3, -0.3, -0.3, -0.3]])
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert [(x["start"], x["tokens"], round(x["mean_abs_diff"], 6)) for x in m["by_length"]] == [(2, 2, 0.1), (4, 4, 0.3)]


def test_length_means_of_rewards():
    rewards, lengths = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([3, 2, 9, 1])
    assert length_means(rewards, lengths, "reward/") == {"reward/len1-2": 1.0, "reward/len2-4": 0.5, "reward/len8-16": 1.0}


def test_confidence_buckets_follow_the_trainers_probability_of_the_sampled_token():
    # p = exp(train): 0.3, 0.6, 0.95, 0.995, 1.0 -> buckets [0, .5), [.5, .9), [.9, .99), [.99, 1] (1 included)
    train = [[math.log(0.3), math.log(0.6)], [math.log(0.95), math.log(0.995), 0.0]]
    rollout = [[math.log(0.3) - 0.4, math.log(0.6) + 0.2], [math.log(0.95) - 0.05, math.log(0.995), -0.01]]
    m = mismatch_metrics(train, rollout)
    b = {(x["start"], x["end"]): x for x in m["by_confidence"]}
    assert sorted(b) == [(0.0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.0)]
    assert b[(0.0, 0.5)]["mean_abs_diff"] == pytest.approx(0.4) and b[(0.0, 0.5)]["tokens"] == 1
    assert b[(0.9, 0.99)]["k3_kl"] == pytest.approx(math.exp(0.05) - 1 - 0.05)
    assert b[(0.99, 1.0)]["tokens"] == 2 and b[(0.99, 1.0)]["mean_abs_diff"] == pytest.approx(0.005)
    assert set(b[(0.5, 0.9)]) == {"start", "end", "tokens", "mean_abs_diff", "k3_kl", "max_abs_diff", "abs_diff_gt1_frac"}
    flat = flat_metrics(m)
    assert flat["mismatch/p0.99-1/tokens"] == 2 and flat["mismatch/p0-0.5/max_abs_diff"] == pytest.approx(0.4)
    assert flat["mismatch/len2-4/tokens"] == 5 and flat["mismatch/pos0-128/tokens"] == 5  # integer edges as before
    sharp = mismatch_metrics([[0.0, 0.0]], [[-0.01, 0.0]])
    assert [x["start"] for x in sharp["by_confidence"]] == [0.99]  # empty buckets are left out
