"""``deal_by_length`` (hybridflow/controller/length_deal.py): prompts dealt to generation ranks
by their expected answer length, and the trainer's record of those lengths
(hybridflow/trainer/reallocated_rollout.py ``AnswerLengths``), and when a step so dealt moves
nothing. No Ray, no engine."""
from __future__ import annotations

import math

import torch

from hybridflow.controller.length_deal import deal_by_length
from hybridflow.protocol import DataProto
from hybridflow.trainer.reallocated_rollout import AnswerLengths


def test_the_rank_dealt_every_long_answer_gets_half_of_them():
    # the reallocation bench's deal: rank 0 (the first half) holds the 6 long answers, rank 1 the 2 others
    lengths = [256, 250, 240, 230, 220, 210, 20, 10] + [200, 190, 15, 12, 9, 8, 5, 4]
    shares = deal_by_length(lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(16)) and len(shares[0]) == len(shares[1]) == 8
    long_ = {i for i, n in enumerate(lengths) if n >= 190}
    assert [len(long_ & set(s)) for s in shares] == [4, 4]
    for share in shares:  # longest first within a share
        assert [lengths[i] for i in share] == sorted((lengths[i] for i in share), reverse=True)


def test_a_snake_deal_evens_the_totals_round_robin_would_not():
    lengths = [100, 90, 80, 70, 60, 50]  # round robin: 240 vs 210; the snake: 100+70+60 vs 90+80+50
    shares = deal_by_length(lengths, 2)
    assert [sum(lengths[i] for i in s) for s in shares] == [230, 220]
    shares = deal_by_length(list(range(10)), 3)  # sizes differ by at most one
    assert sorted(len(s) for s in shares) == [3, 3, 4]


def test_unknown_lengths_count_as_the_median_and_none_known_keeps_the_plain_split():
    assert deal_by_length([math.nan] * 4, 2) is None
    # NaN -> 25, the median of the known: sorted 300, 30, 25, 25, 20, 10, dealt 0 1 1 0 0 1
    assert deal_by_length([math.nan, 300, 10, 20, math.nan, 30], 2) == [[1, 4, 3], [5, 0, 2]]
    assert deal_by_length([5.0], 3) == [[0], [], []]  # fewer prompts than ranks: some get none


def _prompts(rows: list[list[int]], width: int = 4) -> DataProto:
    """Left-padded prompts (pad 0, attention_mask 0 there), as generation requests hold them."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def test_answer_lengths_remember_each_prompt_by_its_tokens_not_its_padding():
    history = AnswerLengths()
    first = _prompts([[5, 6], [7, 8, 9]])
    assert all(math.isnan(x) for x in history.expected(first))
    # n = 2 answers per prompt, in prompt order: 3 and 5 tokens, then 10 and 12
    mask = torch.tensor([[1] * 3 + [0] * 9, [1] * 5 + [0] * 7, [1] * 10 + [0] * 2, [1] * 12])
    history.record(first, DataProto.from_dict({"response_mask": mask}), n=2)
    # the same prompts in another order and padded wider, and one not seen
    later = _prompts([[7, 8, 9], [1, 2], [5, 6]], width=6)
    got = history.expected(later)
    assert got[0] == 11.0 and math.isnan(got[1]) and got[2] == 4.0


def test_a_step_dealt_by_known_lengths_moves_no_sample():
    """The trainer's rebalance threshold: none (no moves) once any prompt's length is known (the
    step is then dealt by length), the configured one while none is (the first epoch) or
    deal_by_length is off."""
    from hybridflow.config.reallocation import ReallocationConfig
    from hybridflow.trainer.reallocated_rollout import rebalance_threshold

    config = ReallocationConfig(enable=True, threshold=0.3)
    assert rebalance_threshold(config, [12.0, 250.0, 3.5]) is None
    assert rebalance_threshold(config, [12.0, math.nan, 3.5]) is None
    assert rebalance_threshold(config, [math.nan] * 3) == 0.3
    assert rebalance_threshold(config, None) == 0.3
