import math

import pytest
import torch

from hybridflow.algorithms import (
    POLICY_LOSSES,
    PolicyLossConfig,
    clipped_value_loss,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
)

# one row of 6 tokens, the last is padding. ratio r = pi/pi_old, advantage A:
#   t0 r=0.5 A=+1 -> max(-0.5, -0.8)            = -0.5  (no clip)
#   t1 r=1.5 A=+1 -> max(-1.5, -1.2)            = -1.2  (clipped at 1.2)
#   t2 r=1.5 A=-1 -> max( 1.5,  1.2)            =  1.5  (no clip; dual bound 3 not hit)
#   t3 r=5.0 A=-2 -> max(10.0,  2.4) = 10 -> min(10, 2*3) = 6  (dual-clip)
#   t4 r=0.5 A=-1 -> max( 0.5,  0.8)            =  0.8  (clipped at 0.8)
RATIOS = [0.5, 1.5, 1.5, 5.0, 0.5, 100.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -2.0, -1.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])
OLD = torch.full((1, 6), -1.0)


def _log_prob():
    return (OLD + torch.tensor([[math.log(r) for r in RATIOS]])).requires_grad_(True)


def test_ppo_clip_with_dual_clip_hand_computed():
    log_prob = _log_prob()
    out = ppo_clip_loss(OLD, log_prob, ADV, MASK, PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=3.0))
    assert out.pg_loss.item() == pytest.approx((-0.5 - 1.2 + 1.5 + 6.0 + 0.8) / 5, abs=1e-5)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 5)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 5)
    assert out.ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in RATIOS[:5]) / 5, abs=1e-6)
    out.pg_loss.backward()
    # d/dlogp of -A*r is -A*r; clipped and dual-clipped tokens (and padding) get no gradient
    expected_grad = [-1.0 * 0.5 / 5, 0.0, 1.0 * 1.5 / 5, 0.0, 0.0, 0.0]
    assert log_prob.grad[0].tolist() == pytest.approx(expected_grad, abs=1e-6)


def test_ppo_clip_without_dual_clip():
    out = ppo_clip_loss(OLD, _log_prob(), ADV, MASK, PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=None))
    assert out.pg_loss.item() == pytest.approx((-0.5 - 1.2 + 1.5 + 10.0 + 0.8) / 5, abs=1e-5)
    assert out.pg_clipfrac_lower.item() == 0.0


def test_asymmetric_clip_higher():
    cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    out = ppo_clip_loss(OLD, _log_prob(), ADV, MASK, cfg)
    assert out.pg_loss.item() == pytest.approx((-0.5 - 1.28 + 1.5 + 6.0 + 0.8) / 5, abs=1e-5)


def test_seq_mean_token_mean_aggregation_is_used():
    adv = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    same = torch.zeros(2, 2)  # ratio 1 -> token loss = -A
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    assert ppo_clip_loss(same, same, adv, mask, cfg).pg_loss.item() == pytest.approx(-1.0)
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum")
    assert ppo_clip_loss(same, same, adv, mask, cfg).pg_loss.item() == pytest.approx(-1.5)


def test_policy_loss_config_and_registry_errors():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_low < 1"):
        PolicyLossConfig(clip_ratio_low=1.5)
    assert get_policy_loss("vanilla") is ppo_clip_loss
    with pytest.raises(ValueError) as err:
        get_policy_loss("clip_cov")
    assert all(name in str(err.value) for name in POLICY_LOSSES)


def test_gspo_clips_the_sequence_ratio_hand_computed():
    # row 0: token log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.2214 > 1 + 0.2: clipped as a whole
    # (per-token PPO would leave the first token, ratio exp(0.1), unclipped); row 1: one valid
    # token, s = exp(-0.05), A = -1: unclipped, loss = s and d loss / d log_prob = s
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.1, 0.3], [-0.05, 9.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = gspo_loss(old, new, adv, mask, PolicyLossConfig(clip_ratio=0.2))
    s1 = math.exp(-0.05)
    assert out.token_losses[0].tolist() == pytest.approx([-1.2, -1.2])
    assert out.token_losses[1, 0].item() == pytest.approx(s1)
    assert out.pg_loss.item() == pytest.approx((-1.2 + s1) / 2)  # seq-mean-token-mean, whatever loss_agg_mode
    assert out.pg_clipfrac.item() == pytest.approx(2 / 3)
    out.pg_loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([0.0, 0.0, s1 / 2, 0.0])
    ppo = ppo_clip_loss(old, new.detach(), adv, mask, PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=None))
    assert ppo.pg_clipfrac.item() == pytest.approx(1 / 3)  # per token: only exp(0.3) is clipped


def test_gspo_on_policy_gradient_is_the_length_normalised_policy_gradient():
    # at ratio 1 (on-policy) each token's gradient is -A_i / |y_i| under seq-mean-token-mean
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    adv = torch.tensor([[2.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = gspo_loss(logp.detach(), logp, adv, mask, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"))
    out.pg_loss.backward()
    expected = [[-2.0 / 3 / 2] * 3, [1.0 / 2 / 2, 1.0 / 2 / 2, 0.0]]
    assert logp.grad.flatten().tolist() == pytest.approx([g for row in expected for g in row])
    assert out.pg_clipfrac.item() == 0.0 and out.ppo_kl.item() == 0.0


def test_clipped_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.8, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    # t0: unclipped (1-2)^2 = 1, clipped vpred 0.5 -> (0.5-2)^2 = 2.25 -> 2.25 (clip active)
    # t1: unclipped (2-1)^2 = 1, clipped vpred 2.0 (inside [1.3, 2.3]) -> 1
    out = clipped_value_loss(vpreds, old_values, returns, mask, cliprange_value=0.5)
    assert out.vf_loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert out.vf_clipfrac.item() == pytest.approx(0.5)
    out.vf_loss.backward()
    # the clipped branch is constant in vpred at t0, so only t1 has a gradient: 0.5*2*(2-1)/2
    assert vpreds.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0])
    plain = clipped_value_loss(vpreds, old_values, returns, mask, cliprange_value=None)
    assert plain.vf_loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="cliprange_value must be > 0"):
        clipped_value_loss(vpreds, old_values, returns, mask, cliprange_value=0.0)
