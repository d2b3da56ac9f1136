"""Properties that must hold for any batch, checked on random small batches."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, PolicyLossConfig, compute_advantage, ppo_clip_loss

FAST = settings(max_examples=25, deadline=None)


@st.composite
def batches(draw):
    groups = draw(st.integers(1, 3))
    per_group = draw(st.integers(2, 4))
    length = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    batch = groups * per_group
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    index = np.repeat(np.arange(groups), per_group).astype(object)
    return rewards, mask, values, index


@FAST
@given(batches(), st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)))
def test_every_estimator_is_zero_on_padding(batch, name):
    rewards, mask, values, index = batch
    adv, ret = compute_advantage(name, rewards, mask, index=index, values=values,
                                 reward_baselines=torch.zeros(len(index)), gamma=0.9, lam=0.95)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@FAST
@given(batches(), st.sampled_from(["grpo", "rloo"]))
def test_group_advantages_sum_to_zero_within_each_group(batch, name):
    rewards, mask, _, index = batch
    adv, _ = compute_advantage(name, rewards, mask, index=index)
    first_token = adv[:, 0]  # the same value on every token of a response
    scores = (rewards * mask).sum(-1)
    for group in set(index.tolist()):
        rows = torch.tensor([i for i, g in enumerate(index) if g == group])
        # fp32 rounding of (score - mean) is ~1e-7 * |score|; GRPO then divides by the group's std,
        # which hypothesis can make small, so the tolerance scales with |score| / std
        group_scores = scores[rows]
        amplification = 1.0 + float(group_scores.abs().max() / (group_scores.std() + 1e-6))
        assert abs(first_token[rows].sum().item()) < 1e-5 * len(rows) * amplification


@FAST
@given(batches())
def test_gae_with_gamma_lam_one_returns_reward_to_go_whatever_the_values(batch):
    rewards, mask, values, _ = batch
    _, ret = compute_advantage("gae", rewards, mask, values=values, gamma=1.0, lam=1.0)
    masked = rewards * mask
    to_go = masked.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, to_go, atol=1e-5, rtol=0)


@FAST
@given(batches())
def test_ppo_loss_at_ratio_one_is_minus_mean_advantage(batch):
    advantages, mask, _, _ = batch
    logp = torch.zeros_like(advantages)
    out = ppo_clip_loss(logp, logp, advantages, mask, PolicyLossConfig())
    expected = -(advantages * mask).sum() / mask.sum()
    torch.testing.assert_close(out.pg_loss, expected, atol=1e-5, rtol=0)
    assert out.pg_clipfrac.item() == 0.0 and out.pg_clipfrac_lower.item() == 0.0
