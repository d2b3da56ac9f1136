"""The time-to-accuracy bench's pure parts (scripts/bench/time_to_accuracy.py): which validation
counts as reaching the target, what a run's summary and the ours/TRL ratio say when a side ran out
of time, and the validation spacing that makes TRL validate after as many training prompts as we
do. No runs: the bench's numbers rest on these, and a slip here (a later crossing, a spacing off by
the batch) would move them silently.
"""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

import _trl_common  # noqa: E402
import time_to_accuracy as tta  # noqa: E402


def _points(*scores, every=20, prompts=64, seconds=10.0):
    return [{"step": i * every, "prompts": i * every * prompts, "seconds": 5.0 + i * seconds,
             "train_s": i * seconds / 2, "score": s} for i, s in enumerate(scores)]


def test_first_crossing_is_the_first_point_at_or_over_the_target():
    points = _points(0.37, 0.59, 0.6, 0.52, 0.7)
    assert tta.first_crossing(points, 0.6)["step"] == 40  # equal counts; the later dip does not matter
    assert tta.first_crossing(points, 0.71) is None
    assert tta.first_crossing([], 0.6) is None


def test_summary_of_a_run_that_reached_and_one_that_did_not():
    reached = tta.summarize(_points(0.37, 0.5, 0.65), 0.6, wall_s=30.0, startup_s=4.0)
    assert reached["reached"] and reached["time_to_target_s"] == 25.0 and reached["train_time_to_target_s"] == 10.0
    assert (reached["steps"], reached["prompts"]) == (40, 2560)
    assert reached["curve"] == [[5.0, 0.37], [15.0, 0.5], [25.0, 0.65]]
    missed = tta.summarize(_points(0.37, 0.55, 0.5), 0.6, wall_s=480.0, startup_s=4.0)
    assert not missed["reached"] and "time_to_target_s" not in missed
    assert (missed["best_score"], missed["best_at_s"], missed["steps"]) == (0.55, 15.0, 40)


def test_ratio_is_a_bound_when_one_side_ran_out_of_time():
    ours = {"reached": True, "time_to_target_s": 60.0, "train_time_to_target_s": 30.0, "wall_s": 61.0}
    trl = {"reached": True, "time_to_target_s": 240.0, "train_time_to_target_s": 200.0, "wall_s": 241.0}
    capped = {"reached": False, "wall_s": 480.0}
    assert tta.ratio(ours, trl) == {"ratio": 0.25, "train_ratio": 0.15}
    assert tta.ratio(ours, capped) == {"ratio_at_most": 0.125}  # TRL would take longer than its cap
    assert tta.ratio(capped, trl) == {"ratio_at_least": 2.0}
    assert tta.ratio(capped, capped) is None
    assert tta.ratio({"error": "boom"}, trl) is None


def test_validation_spacing_matches_prompts_consumed():
    # the demo: every 20 of our steps of 64 prompts = every 1280 of TRL's default 1-prompt steps
    assert _trl_common.steps_between_validations(20 * 64, 1) == 1280
    assert _trl_common.steps_between_validations(20 * 64, 64) == 20  # TRL at our batch
    with pytest.raises(ValueError):
        _trl_common.steps_between_validations(80, 48)  # no whole number of steps
    with pytest.raises(ValueError):
        _trl_common.steps_between_validations(8, 16)


def test_overrides_are_read_as_hydra_reads_them():
    overrides = ["data.train_files=[data/a/train.parquet]", "trainer.test_freq=20", "trainer.test_freq=5",
                 "+actor_rollout_ref.rollout.n=8"]
    assert tta.override(overrides, "trainer.test_freq") == "5"  # the last one wins
    assert tta.override(overrides, "actor_rollout_ref.rollout.n") == "8"
    assert tta.override(overrides, "actor_rollout_ref.actor.optim.lr", "1e-5") == "1e-5"
    assert tta.first_file(tta.override(overrides, "data.train_files")) == "data/a/train.parquet"
