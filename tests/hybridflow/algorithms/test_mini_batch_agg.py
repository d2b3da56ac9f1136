"""Whole-mini-batch loss aggregation: micro-batch shares on several ranks add up to the mode's
value on the whole mini-batch, for every loss_agg_mode, whatever the micro-batch size, and
leaving out zero-loss rows changes nothing as long as the denominators count them."""
import pytest
import torch

from hybridflow.algorithms.loss_agg import LOSS_AGG_MODES, agg_loss, agg_loss_parts
from hybridflow.algorithms.mini_batch_agg import (META_DP_SIZE, META_GLOBAL_NONEMPTY_ROWS, META_GLOBAL_ROWS,
                                                  META_GLOBAL_TOKENS, META_MINI_BATCH_ROWS, mini_batch_agg,
                                                  single_batch_meta)

MODES = sorted(LOSS_AGG_MODES)


def batch(rows: int = 12, length: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, length, generator=gen)
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    lengths[0] = 0  # an empty response: left out of the seq-mean modes' count
    mask = (torch.arange(length) < lengths[:, None]).float()
    return values, mask


@pytest.mark.parametrize("mode", MODES)
def test_parts_divide_to_agg_loss(mode):
    values, mask = batch()
    num, den = agg_loss_parts(values, mask, mode)
    assert float(num / den) == pytest.approx(float(agg_loss(values, mask, mode)), abs=1e-6)
    meta = single_batch_meta(mask)
    assert float(mini_batch_agg(values, mask, mode, meta, len(values))) == pytest.approx(float(num / den), abs=1e-6)


def accumulate(values, mask, mode, ranks: int, micro: int, keep=None) -> float:
    """What the engines back-propagate: each micro share x m/M, summed, averaged over ranks."""
    meta = {META_DP_SIZE: ranks, META_GLOBAL_TOKENS: int(mask.sum()), META_GLOBAL_ROWS: len(values),
            META_GLOBAL_NONEMPTY_ROWS: int((mask.sum(-1) > 0).sum())}
    total = 0.0
    for rank_rows in torch.arange(len(values)).chunk(ranks):
        if keep is not None:
            rank_rows = rank_rows[keep[rank_rows]]
        for part in rank_rows.split(micro):
            share = mini_batch_agg(values[part], mask[part], mode,
                                   {**meta, META_MINI_BATCH_ROWS: len(rank_rows)}, len(part))
            total += float(share) * len(part) / len(rank_rows)
    return total / ranks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks,micro", [(1, 12), (1, 5), (2, 1), (2, 4), (3, 2)])
def test_micro_batch_shares_add_up_to_the_mini_batch_value(mode, ranks, micro):
    values, mask = batch()
    assert accumulate(values, mask, mode, ranks, micro) == pytest.approx(float(agg_loss(values, mask, mode)),
                                                                         abs=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_rows_with_zero_loss_may_be_left_out(mode):
    values, mask = batch()
    inert = torch.tensor([i % 3 == 1 for i in range(len(values))])
    values[inert] = 0.0
    keep = ~inert
    full = float(agg_loss(values, mask, mode))
    assert accumulate(values, mask, mode, 2, 2, keep=keep) == pytest.approx(full, abs=1e-5)
