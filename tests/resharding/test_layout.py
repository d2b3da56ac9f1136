"""Rank coordinates and groups of the training and generation layouts."""
from resharding.layout import GenLayout, TrainLayout, micro_dp_groups, pipeline_groups


def test_megatron_rank_order_round_trips():
    train = TrainLayout(pp=2, tp=2, dp=2)
    assert [train.coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert all(train.rank(*[train.coords(r)[i] for i in (0, 1, 2)]) == r for r in range(8))
    assert pipeline_groups(train) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_generation_groups_vllm_and_paper():
    train = TrainLayout(pp=1, tp=4, dp=2)  # the paper's 1-4-2 training layout, 8 ranks
    vllm = GenLayout(2, 8)
    assert [vllm.dp_rank(r) for r in range(8)] == [r // 2 for r in range(8)]  # contracts.md
    assert vllm.tp_group(5) == [4, 5]
    paper = GenLayout(2, 8, "strided")  # Sec. 5.4: generation TP groups strided, micro-DP consecutive
    assert [paper.tp_group(r, train) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert micro_dp_groups(train, paper) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [paper.tp_rank(r, train) for r in range(4)] == [0, 0, 1, 1]
    assert sorted({paper.dp_rank(r, train) for r in range(8)}) == [0, 1, 2, 3]
