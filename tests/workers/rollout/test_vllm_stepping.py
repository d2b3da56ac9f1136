"""perf/gen_tail_share's arithmetic (the engine-driven part is checked against LLM.generate in
test_vllm_rollout.py, on that test's engines)."""
import pytest

from workers.rollout.vllm_stepping import tail_share


def test_tail_share_is_the_time_after_the_median_finish_over_the_call():
    # start 10; 8 samples: the median finish (mean of the 4th and 5th) is 12, the last 20
    assert tail_share(10.0, [11, 11, 12, 12, 12, 13, 15, 20]) == pytest.approx(8 / 10)
    assert tail_share(0.0, [1.0, 3.0, 2.0]) == pytest.approx(1 / 3)  # odd count: the middle one, in any order


def test_tail_share_is_zero_when_every_sample_ends_together_or_none_ran():
    assert tail_share(5.0, [7.0] * 4) == 0.0
    assert tail_share(5.0, []) == 0.0
    assert tail_share(5.0, [5.0]) == 0.0  # no measurable time: no division by zero
