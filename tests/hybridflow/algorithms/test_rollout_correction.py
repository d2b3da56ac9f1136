"""Rollout correction (hybridflow/algorithms/rollout_correction.py) against hand-computed values."""
import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import parse_rs_thresholds, rollout_correction

L2 = math.log(2.0)
# two rows of three tokens, the second row's last token is padding.
# log rho = old - rollout: row 0: [ln 2, 0, -ln 2]; row 1: [ln 4, ln 2, (pad, 5.0)]
ROLLOUT = torch.zeros(2, 3) - 1.0
OLD = ROLLOUT + torch.tensor([[L2, 0.0, -L2], [2 * L2, L2, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_tis_truncates_each_token_and_zeros_padding():
    out = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", rollout_is_threshold=3.0)
    # rho = [2, 1, 0.5], [4, 2, -]; truncated at 3
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 1.0, 0.5], [3.0, 2.0, 0.0]]))
    assert out.response_mask is MASK  # no rejection asked
    m = out.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1 + 0.5 + 4 + 2) / 5)  # before truncation
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 4 > 3
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # none < 1/3
    w = torch.tensor([2.0, 1.0, 0.5, 3.0, 2.0])
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(float(w.mean() ** 2 / (w ** 2).mean()))


def test_sequence_tis_is_the_product_of_ratios_per_row():
    out = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="sequence", rollout_is_threshold=5.0)
    # row 0: 2 * 1 * 0.5 = 1; row 1: 4 * 2 = 8 -> 5 (the padding's 5.0 does not count)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 1.0], [5.0, 5.0, 0.0]]))
    m = out.metrics
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(8.0)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # one row of two


def test_batch_normalize_gives_mean_one():
    tok = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", rollout_is_threshold=3.0,
                             rollout_is_batch_normalize=True)
    mean = (2 + 1 + 0.5 + 3 + 2) / 5
    torch.testing.assert_close(tok.weights, torch.tensor([[2.0, 1.0, 0.5], [3.0, 2.0, 0.0]]) / mean)
    assert tok.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    seq = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="sequence", rollout_is_threshold=5.0,
                             rollout_is_batch_normalize=True)
    # the mean over sequences (1 and 5), not over tokens (which would weigh row 0 by 3 tokens)
    torch.testing.assert_close(seq.weights, torch.tensor([[1.0, 1.0, 1.0], [5.0, 5.0, 0.0]]) / 3.0)


def test_token_rejection_k1_ratio_bounds():
    # threshold 3: keep rho in [1/3, 3]; only the token with rho 4 goes
    out = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="token_k1", rollout_rs_threshold=3.0)
    torch.testing.assert_close(out.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    assert out.weights is None
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert out.metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)


def test_geometric_mean_rejection_drops_whole_rows():
    # seq_mean_k1: -mean log rho; row 0: 0 (geometric mean ratio 1), row 1: -1.5 ln 2 (ratio 2^1.5 = 2.83)
    out = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="seq_mean_k1", rollout_rs_threshold=2.5)
    torch.testing.assert_close(out.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    kept = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="seq_mean_k1", rollout_rs_threshold=3.0)
    torch.testing.assert_close(kept.response_mask, MASK)


def test_sequence_k2_and_k3_and_two_options_combine():
    # seq_sum_k2: sum (log rho)^2 / 2; row 0: ln2^2 = 0.48, row 1: 2.5 ln2^2 = 1.20
    out = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="seq_sum_k2", rollout_rs_threshold=1.0)
    torch.testing.assert_close(out.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # token_k3 = rho - 1 - ln rho: 2-1-ln2 = 0.307, 0, 0.5-1+ln2 = 0.193, 4-1-2ln2 = 1.61, 0.307
    # with token_k3 <= 1 and seq_max_k2 <= 0.5 (row 0 max 0.24, row 1 max 0.96): row 1 goes entirely
    both = rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="1.0,0.5")
    torch.testing.assert_close(both.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    m = both.metrics
    assert m["rollout_corr/rollout_rs_token_k3_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)


def test_offpolicy_metrics():
    m = rollout_correction(OLD, ROLLOUT, MASK).metrics
    assert m["rollout_corr/kl"] == pytest.approx(-(L2 + 0 - L2 + 2 * L2 + L2) / 5)
    k3 = [2 - 1 - L2, 0.0, 0.5 - 1 + L2, 4 - 1 - 2 * L2, 2 - 1 - L2]
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(k3) / 5)
    # per-row mean log-probs: rollout -1, -1; old -1, -1 + 1.5 ln2
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.e)
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.e + math.exp(1 - 1.5 * L2)) / 2)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(-0.75 * L2)
    assert "rollout_corr/rollout_is_mean" not in m


def test_threshold_parsing_and_errors():
    assert parse_rs_thresholds(["token_k1"], 2.0) == {"token_k1": (0.5, 2.0)}
    assert parse_rs_thresholds(["seq_sum_k1", "token_k2"], "0.8_1.5,3") == {
        "seq_sum_k1": (0.8, 1.5), "token_k2": (None, 3.0)}
    with pytest.raises(ValueError, match="token_k2 takes one upper bound"):
        parse_rs_thresholds(["token_k2"], "0.5_2")
    with pytest.raises(ValueError, match="2 thresholds for 3"):
        parse_rs_thresholds(["token_k1", "token_k2", "token_k3"], "1,2")
    with pytest.raises(ValueError, match="not a number"):
        parse_rs_thresholds(["token_k1"], "a_b")
    with pytest.raises(ValueError, match="must be set"):
        parse_rs_thresholds(["token_k1"], None)
    with pytest.raises(ValueError, match="must be positive"):
        parse_rs_thresholds(["token_k3"], -1)
    with pytest.raises(ValueError, match="shapes differ"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK)
