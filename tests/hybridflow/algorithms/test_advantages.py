import math
import statistics

import numpy as np
import pytest
import torch

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, compute_advantage, get_advantage_estimator


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def _whiten(xs):
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    return [(x - mean) / std for x in xs]


def test_gae_hand_computed_two_sequences():
    # row 0: 2 valid tokens; row 1: 3 valid tokens. gamma=0.9, lam=0.8.
    rewards = torch.tensor([[0.0, 1.0, 5.0], [0.5, 0.0, 2.0]])  # 5.0 sits on padding: ignored
    values = torch.tensor([[0.5, 0.2, 9.0], [1.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: d1 = 1 - 0.2 = 0.8, A1 = 0.8; d0 = 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.8 = 0.256
    # row 1: d2 = 2 - 1 = 1, A2 = 1; d1 = 0 + 0.9*1 - 0 = 0.9, A1 = 0.9 + 0.72*1 = 1.62
    #        d0 = 0.5 + 0.9*0 - 1 = -0.5, A0 = -0.5 + 0.72*1.62 = 0.6664
    raw = [[0.256, 0.8], [0.6664, 1.62, 1.0]]
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    _close(ret, [[0.756, 1.0, 0.0], [1.6664, 1.62, 2.0]], 1e-6)
    white = _whiten(raw[0] + raw[1])
    _close(adv, [white[:2] + [0.0], white[2:]], 1e-5)


def test_gae_skips_masked_holes():
    # the middle token is an observation (mask 0): its reward and value must not matter
    rewards = torch.tensor([[0.0, 7.0, 1.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 9.0, 0.2], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    _, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    assert ret[0].tolist() == pytest.approx([0.756, 0.0, 1.0], abs=1e-6)


def test_gae_gamma_lam_one_equals_monte_carlo_return():
    rewards = torch.tensor([[0.1, 0.2, 0.3, 1.0]])
    values = torch.tensor([[0.4, -0.3, 2.0, 0.7]])
    _, ret = compute_advantage("gae", rewards, torch.ones(1, 4), values=values)
    _close(ret, [[1.6, 1.5, 1.3, 1.0]], 1e-6)


def _outcome(scores, lengths, R=3):
    rewards = torch.zeros(len(scores), R)
    mask = torch.zeros(len(scores), R, dtype=torch.long)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


def test_grpo_group_normalised_with_std():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 1.0, 1.0], [3, 2, 1, 3, 2])
    index = np.array(["a", "a", "a", "b", "b"], dtype=object)
    adv, ret = compute_advantage("grpo", rewards, mask, index=index)
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    expected = [(2 / 3) / std_a, -(1 / 3) / std_a, -(1 / 3) / std_a, 0.0, 0.0]  # group b: all equal
    for i, n in enumerate([3, 2, 1, 3, 2]):
        assert adv[i, :n].tolist() == pytest.approx([expected[i]] * n, abs=1e-5)
        assert adv[i, n:].abs().sum().item() == 0.0
    assert torch.equal(adv, ret)


def test_grpo_without_std_is_dr_grpo():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 0.5, 1.5], [1, 1, 1, 1, 1])
    index = np.array([0, 0, 0, 1, 1])
    adv, _ = compute_advantage("grpo", rewards, mask, index=index, norm_adv_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -0.5, 0.5], abs=1e-6)


def test_grpo_singleton_group_keeps_raw_score_and_index_length_checked():
    rewards, mask = _outcome([0.7, 1.0, 0.0], [1, 1, 1])
    adv, _ = compute_advantage("grpo", rewards, mask, index=np.array(["x", "y", "y"], dtype=object))
    assert adv[0, 0].item() == pytest.approx(0.7, abs=1e-5)
    with pytest.raises(ValueError, match="index has 2 uids for 3 rows"):
        compute_advantage("grpo", rewards, mask, index=np.array(["x", "y"]))
    with pytest.raises(ValueError, match="grpo.*needs a group uid"):
        compute_advantage("grpo", rewards, mask)


def test_rloo_leave_one_out_baseline():
    rewards, mask = _outcome([1.0, 0.0, 3.0, 2.0, 4.0], [2, 3, 1, 1, 1])
    adv, ret = compute_advantage("rloo", rewards, mask, index=np.array(["p", "p", "p", "q", "q"]))
    expected = [1 - 1.5, 0 - 2.0, 3 - 0.5, 2 - 4.0, 4 - 2.0]
    for i, n in enumerate([2, 3, 1, 1, 1]):
        assert adv[i, :n].tolist() == pytest.approx([expected[i]] * n, abs=1e-6)
        assert adv[i, n:].abs().sum().item() == 0.0
    assert torch.equal(adv, ret)


def test_remax_subtracts_greedy_baseline_from_return_to_go():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=torch.tensor([0.5, 1.0]))
    _close(ret, [[1.5, 1.5, 1.0], [2.0, 2.0, 0.0]])
    _close(adv, [[1.0, 1.0, 0.5], [1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="remax.*greedy"):
        compute_advantage("remax", rewards, mask)


def test_reinforce_plus_plus_discounted_returns_globally_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    _close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    white = _whiten([0.25, 0.5, 1.0, 1.0, 2.0])
    _close(adv, [white[:3], white[3:] + [0.0]], 1e-5)


def test_registry_names_flags_and_errors():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "rloo", "remax", "reinforce_plus_plus"}
    assert get_advantage_estimator("gae").needs_critic
    assert get_advantage_estimator("grpo").needs_groups and not get_advantage_estimator("grpo").needs_critic
    assert get_advantage_estimator("remax").needs_greedy_baseline
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("ppo")
    assert "adv_estimator" in str(err.value) and "reinforce_plus_plus" in str(err.value)
    with pytest.raises(ValueError, match="critic"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2))
