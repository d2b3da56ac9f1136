"""The long-tail model builder's pure parts (scripts/bench/workloads/count_model.py): the length
profile and its comparison with the data's (the SFT pairs: tests/hybridflow/data/test_task_files.py).
The SFT and sampling are not run here."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))

from workloads.count_model import greedy_has_body, percentile_profile, profile_gaps, profile_matches  # noqa: E402


def test_percentile_profile_interpolates_like_numpy():
    # 80 short answers and 20 long ones: p80 falls between the two groups (linear interpolation)
    profile = percentile_profile([4] * 80 + [100] * 20)
    assert profile == {"p50": 4.0, "p80": 23.2, "p95": 100.0, "mean": 23.2, "max": 100}


def test_profile_match_needs_every_percentile_within_tolerance():
    data = {"p50": 20.0, "p80": 32.0, "p95": 160.0}
    assert profile_gaps({"p50": 25.0, "p80": 32.0, "p95": 120.0}, data) == {"p50": 0.25, "p80": 0.0, "p95": -0.25}
    assert profile_matches({"p50": 25.0, "p80": 32.0, "p95": 120.0}, data, tolerance=0.25)
    # right body, tail too short (answers that stop early): no match on p95 alone
    assert not profile_matches({"p50": 20.0, "p80": 32.0, "p95": 100.0}, data, tolerance=0.25)
    # the tail right, but too many long answers in the body (p80)
    assert not profile_matches({"p50": 20.0, "p80": 60.0, "p95": 160.0}, data, tolerance=0.25)


def test_a_greedy_median_at_the_limit_has_no_body():
    # measured on an AVX2-only CPU: 80 SFT steps matched the sampled profile, and greedy answers
    # ran to the 256-token limit for most prompts; 160 steps gave a body and a tail at the limit
    assert not greedy_has_body({"p50": 256.0, "p80": 256.0, "p95": 256.0})
    assert greedy_has_body({"p50": 28.0, "p80": 256.0, "p95": 256.0})
    assert not greedy_has_body({"p50": 64.0, "p80": 120.0, "p95": 128.0}, limit=128)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
