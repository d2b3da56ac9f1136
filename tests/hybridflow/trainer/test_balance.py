"""trainer.balance_batch: the rows' order that evens the tokens per data-parallel rank."""
import numpy as np
import pytest
import torch

from hybridflow.trainer.balance import balanced_order


def _loads(tokens, order, parts):
    return tokens[order].view(parts, -1).sum(-1).tolist()


def test_groups_stay_together_and_the_ranks_get_even_tokens():
    n, groups, parts = 4, 8, 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 200, (groups * n,), generator=gen)
    tokens[: groups // 2 * n] += 300  # the first half of the prompts are long: rank 0 would get all of them
    uids = np.repeat([f"p{g}" for g in range(groups)], n)
    order, metrics = balanced_order(tokens, uids, parts)
    assert sorted(order.tolist()) == list(range(groups * n))
    reordered = uids[order.numpy()]
    for start in range(0, len(reordered), n):  # a prompt's samples, consecutive and in their order
        block = order[start:start + n].tolist()
        assert len(set(reordered[start:start + n])) == 1 and block == list(range(block[0], block[0] + n))
    before, after = _loads(tokens, torch.arange(len(tokens)), parts), _loads(tokens, order, parts)
    assert max(after) - min(after) < (max(before) - min(before)) / 4
    assert metrics["global_seqlen/max"] == max(after) and metrics["global_seqlen/unbalanced_max"] == max(before)
    # every rank holds the same number of prompts (the worker group deals out equal chunks)
    assert [len(set(reordered[k * 16:(k + 1) * 16])) for k in range(parts)] == [4, 4]


def test_rows_are_placed_one_by_one_when_the_groups_do_not_divide_over_the_ranks():
    tokens = torch.tensor([100, 100, 100, 1, 1, 1])
    uids = np.array(["a", "a", "a", "b", "b", "b"])  # 2 groups over 3 ranks
    order, metrics = balanced_order(tokens, uids, 3)
    assert sorted(order.tolist()) == list(range(6))
    assert _loads(tokens, order, 3) == [101, 101, 101]
    assert metrics["global_seqlen/minmax_diff"] == 0


def test_one_rank_keeps_the_order_and_a_bad_split_is_an_error():
    tokens, uids = torch.tensor([5, 9, 2, 7]), np.array(["a", "a", "b", "b"])
    assert balanced_order(tokens, uids, 1)[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="5 rows do not split over 2"):
        balanced_order(torch.ones(5), np.array(list("abcde")), 2)
