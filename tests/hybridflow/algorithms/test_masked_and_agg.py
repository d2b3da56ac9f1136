import math

import pytest
import torch

from hybridflow.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    get_loss_agg,
    masked_mean,
    masked_var,
    masked_whiten,
)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_masked_mean_ignores_inf_and_nan_in_padding():
    values = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.5, 3.0])


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_masked_var_is_unbiased_and_whiten_zeroes_padding():
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # var([1,2,3], ddof=1)
    white = masked_whiten(values, mask)
    _close(white, [[-1.0, 0.0], [1.0, 0.0]], 1e-6)
    unshifted = masked_whiten(values, mask, shift_mean=False)
    _close(unshifted, [[1.0, 2.0], [3.0, 0.0]], 1e-6)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="same \\[B, R\\] shape"):
        masked_mean(torch.ones(2, 3), torch.ones(2, 4))


# rows: token losses [1,2,3] (3 valid), [4] (1 valid), nothing valid
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),  # the empty row is left out of the mean
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4 + 0) / 3 / 3),  # mean over all rows / R
    ],
)
def test_loss_aggregation_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_with_explicit_length():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(10 / 3 / 10)


def test_unknown_loss_agg_mode_lists_known_names():
    with pytest.raises(ValueError) as err:
        get_loss_agg("mean")
    for name in LOSS_AGG_MODES:
        assert name in str(err.value)


def test_entropy_from_logits_uniform_and_peaked():
    uniform = entropy_from_logits(torch.zeros(2, 4))
    assert uniform.tolist() == pytest.approx([math.log(4)] * 2)
    peaked = entropy_from_logits(torch.tensor([[1000.0, 0.0, -1000.0]]))
    assert torch.isfinite(peaked).all() and peaked.item() == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.7, 0.2, 0.1])
    expected = -(p * p.log()).sum().item()
    assert entropy_from_logits(p.log().unsqueeze(0)).item() == pytest.approx(expected, rel=1e-6)
