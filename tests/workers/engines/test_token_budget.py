"""Micro-batches by token budget: consecutive rows, padded cost within the budget, equal counts."""
import torch

from hybridflow.protocol import DataProto
from workers.engines.token_budget import groups_within, _split_to, micro_batches, token_budget_micro_batches


def _batch(spans, width=12):
    """Rows whose real tokens cover ``[first, last)`` of ``width`` columns."""
    mask = torch.zeros(len(spans), width, dtype=torch.long)
    for i, (first, last) in enumerate(spans):
        mask[i, first:last] = 1
    return DataProto.from_dict({"attention_mask": mask, "input_ids": torch.arange(len(spans))[:, None] + mask * 0})


def test_groups_count_rows_times_the_columns_they_span():
    # 3 rows spanning 4 columns fit 12; a 4th widening the span to 6 would cost 24
    assert groups_within([(2, 6), (3, 6), (2, 5), (0, 6), (0, 6)], 12) == [3, 2]
    assert groups_within([(0, 12), (0, 3)], 8) == [1, 1]  # a row wider than the budget goes alone
    assert groups_within([], 8) == []


def test_split_halves_the_largest_group_until_the_count_is_reached():
    assert _split_to([5, 2], 3) == [3, 2, 2]
    assert _split_to([5, 2], 4) == [2, 1, 2, 2]
    assert _split_to([1, 1], 2) == [1, 1]


def test_micro_batches_keep_row_order_and_every_row():
    data = _batch([(2, 6), (3, 6), (2, 5), (0, 6), (0, 6), (5, 7)])
    parts = token_budget_micro_batches(data, 12)
    assert [len(p) for p in parts] == [3, 2, 1]
    assert torch.equal(torch.cat([p.batch["input_ids"][:, 0] for p in parts]), torch.arange(6))
    for part in parts:
        real = part.batch["attention_mask"].bool()
        cols = torch.nonzero(real.any(0)).flatten()
        assert len(part) * (int(cols.max()) + 1 - int(cols.min())) <= 12
    assert [len(p) for p in micro_batches(data, 4, None)] == [4, 2]  # no budget: fixed row count
