"""Sample reallocation's remaining-work estimate (hybridflow/controller/remaining_work.py, as
``GenerationStream._work`` uses it) and the move the stream decides on it, on the controller alone
(no Ray, no engine): each replica's progress report as a worker's ``stream_step`` sends it,
(row_index, tokens generated, max_tokens) per unfinished sample.

The case reallocation exists for, in a first epoch where no answer's length is known: both ranks
hold the same number of unfinished samples, but one rank's answers end short and the other's have
all run on without ending. A count sees no difference; the estimate does, and the move takes that
rank's queued samples, about half the gap's worth, in one go."""
from __future__ import annotations

import math

import pytest

from hybridflow.controller.stream import GenerationStream, Replica

CAP = 256  # max_tokens


def _stream(progress: list[list[tuple[int, int, int]] | None], finished: list[list[int]], dealt: list[list[int]],
            rebalance: float = 0.25, move_started: bool = False):
    """A stream of ``len(progress)`` replicas (one rank each), n = 1: replica k was dealt the rows
    ``dealt[k]``, has ``finished[k]``'s lengths finished (of its dealt rows) and reports
    ``progress[k]``; the exports it would queue are recorded, not sent."""
    stream = GenerationStream.__new__(GenerationStream)
    stream.replicas = []
    for k, report in enumerate(progress):
        replica = Replica(k, [k], k)
        replica.progress, replica.open = report, True
        replica.unfinished = len(report or [])
        replica.unstarted = sum(1 for _, generated, _ in report or [] if generated == 0)
        stream.replicas.append(replica)
    stream.rebalance, stream.move_started, stream._moving = rebalance, move_started, False
    stream._origin = {row: k for k, rows in enumerate(dealt) for row in rows}
    stream._finished_tokens = [sum(lengths) for lengths in finished]
    stream._finished_count = [len(lengths) for lengths in finished]
    stream.queued = []
    stream._queue = lambda replica, method, *args: stream.queued.append((replica.dp_rank, method, args))
    return stream


def _lopsided(step: int = 20):
    """64 samples per rank, 32 seats: rank 0's 32 running have run ``step`` tokens and none ended
    (its answers are long), 32 wait; rank 1 ended 8 answers of 18 tokens, runs 24 and waits 32."""
    rank0 = [(row, step, CAP) for row in range(32)] + [(row, 0, CAP) for row in range(32, 64)]
    rank1 = [(row, step, CAP) for row in range(72, 96)] + [(row, 0, CAP) for row in range(96, 128)]
    return _stream([rank0, rank1], finished=[[], [18] * 8], dealt=[list(range(64)), list(range(64, 128))])


def test_a_rank_whose_answers_have_not_ended_is_judged_long():
    stream = _lopsided()
    means = stream._mean_lengths()
    assert means[0] == math.inf  # none ended: each sample counts as what its max_tokens leave
    assert means[1] == pytest.approx((8 * 18 + 24 * 20) / 8)  # censored mean: every token over the ended count
    work = [stream._work(r, means, counted=False) for r in stream.replicas]
    assert work[0] == 32 * (CAP - 20) + 32 * CAP
    assert work[1] == pytest.approx(56 * means[1])
    assert work[0] > 3 * work[1]  # the same count of unfinished samples on both (64 and 56)


def test_the_move_takes_half_the_gap_of_queued_samples_in_one_go():
    stream = _lopsided()
    stream._reallocate()
    assert len(stream.queued) == 1
    rank, method, (count, unstarted_only) = stream.queued[0]
    assert (rank, method, unstarted_only) == (0, "stream_export", True)
    means = stream._mean_lengths()
    gap = stream._work(stream.replicas[0], means, False) - stream._work(stream.replicas[1], means, False)
    assert count == round(gap / 2 / CAP)  # queued samples, CAP tokens each on rank 0's estimate
    assert 16 <= count <= 32  # a count would move half of 64 - 56 = 4
    assert stream.replicas[0].export_to[0] is stream.replicas[1]
    stream._reallocate()  # one move in flight: no second decision until it lands
    assert len(stream.queued) == 1


def test_queued_samples_only_unless_move_started():
    # rank 0 has nothing queued: with queued samples only, nothing moves
    running = [(row, 20, CAP) for row in range(32)]
    stream = _stream([running, [(64, 20, CAP)]], finished=[[], [18] * 31], dealt=[list(range(32)), list(range(32, 65))])
    stream._reallocate()
    assert stream.queued == []
    stream = _stream([running, [(64, 20, CAP)]], finished=[[], [18] * 31], dealt=[list(range(32)), list(range(32, 65))],
                     move_started=True)
    stream._reallocate()
    (rank, method, (count, unstarted_only)), = stream.queued
    assert rank == 0 and not unstarted_only and 1 <= count < 32


def test_counts_stand_in_while_a_rank_has_not_reported_its_progress():
    """Before a rank's first slice, or from a worker that does not report progress, every rank's
    work is its unfinished count (tokens and counts would not compare)."""
    stream = _lopsided()
    stream.replicas[1].progress = None
    means = stream._mean_lengths()
    assert [stream._work(r, means, counted=True) for r in stream.replicas] == [64.0, 56.0]
    stream._reallocate()  # 64 - 56 = 8 is under a quarter of 64
    assert stream.queued == []


def test_balanced_ranks_move_nothing():
    # the same answers so far on both ranks, one a step behind the other in its reports
    rank0 = [(row, 20, CAP) for row in range(32)] + [(row, 0, CAP) for row in range(32, 64)]
    rank1 = [(row, 19, CAP) for row in range(64, 96)] + [(row, 0, CAP) for row in range(96, 128)]
    stream = _stream([rank0, rank1], finished=[[], []], dealt=[list(range(64)), list(range(64, 128))])
    stream._reallocate()
    assert stream.queued == []
