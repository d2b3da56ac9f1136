"""The agent-loop bench's pure parts (scripts/bench/agent_loop.py): the turn lengths it feeds both
modes are seeded and long-tailed as stated, and the ideal ratio is lockstep's steps over the
longest trajectory's."""
import os
import sys

import numpy as np

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
import agent_loop  # noqa: E402


def test_turn_lengths_are_seeded_clipped_and_a_share_runs_long():
    lengths = agent_loop.turn_lengths(64, 3, 8, 1.0, 2, 64, 0, long_share=0.05, long_range=(192, 256))
    assert lengths == agent_loop.turn_lengths(64, 3, 8, 1.0, 2, 64, 0, long_share=0.05, long_range=(192, 256))
    arr = np.asarray(lengths)
    assert arr.shape == (64, 3)
    long = arr >= 192
    assert ((arr >= 2) & (arr <= 64) | long & (arr <= 256)).all()
    assert 0.01 < long.mean() < 0.12 and np.median(arr) < 16
    assert not (np.asarray(agent_loop.turn_lengths(64, 3, 8, 1.0, 2, 64, 0)) > 64).any()


def test_ideal_ratio_is_the_sum_of_turn_maxima_over_the_longest_trajectory():
    # lockstep: 10 + 20 + 30 = 60 steps (each turn waits for its longest); per trajectory: 1 + 4 + 30 = 35
    lengths = [[10, 1, 1], [1, 20, 1], [1, 4, 30]]
    assert agent_loop.ideal_ratio(lengths) == 60 / 35
