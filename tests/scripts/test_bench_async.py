"""The async bench's pure parts (scripts/bench/async.py): each run's overrides are a config that
passes the checks before start-up, with the pools it claims, and the overlap bound it prints."""
import importlib
import os
import sys
from types import SimpleNamespace

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
bench = importlib.import_module("async")  # a keyword: not importable by the statement


@pytest.mark.parametrize("run, rollout_world, staleness", [("one_step_off", 1, 1.0), ("turns", 1, 0.0),
                                                           ("colocated", 0, 0.0)])
def test_each_run_is_a_valid_config_on_two_slots(run, rollout_world, staleness):
    from hybridflow.config import load_config, validate
    from hybridflow.config.derived import derive
    from recipes.cli import compose_config

    args = SimpleNamespace(prompt_length=24, response_length=256, prompts=16, samples=8, lr=1e-5, steps=7, workers=2,
                           micro_batch=0,
                           overrides=[])
    paths = {"model": "/m", "data": "/d"}
    cfg = load_config(compose_config("grpo", [*bench.overrides(args, paths), *bench.RUNS[run]]))
    validate(cfg, check_paths=False, available_slots=2)
    d = derive(cfg)
    assert (d.rollout_world, d.total_workers, cfg.async_training.staleness_threshold) == (rollout_world, 2, staleness)


def test_the_overlap_bound_hides_the_shorter_stage():
    assert bench.overlap_bound({"step_s": 6.0, "timing_s": {"gen": 2.0}}) == 1.5
    assert bench.overlap_bound({"step_s": 6.0, "timing_s": {"gen": 4.0}}) == 1.5
    assert bench.overlap_bound({"error": "x"}) is None
