"""``actor_rollout_ref.rollout.reallocation.enable`` through the real recipe (two colocated slots,
tiny fp32 model, greedy, one-step slices): the unfused step generates through a rebalancing
GenerationStream (hybridflow/trainer/reallocated_rollout.py) and trains on its batch; every step
logs the moves (one step: the wiring is what is checked), and what one rank exported the other
adopted. That the streamed batch is generate_sequences' own, row for row, is checked on a worker
group in tests/hybridflow/controller/test_stream.py (same code path, no recipe)."""
from __future__ import annotations

import math

import pytest

from tests.hybridflow.trainer.recipe_runs import make_assets, read_steps, run_recipe

pytestmark = pytest.mark.slow


def test_a_step_generates_through_the_rebalancing_stream(tmp_path):
    assets = make_assets(tmp_path, train_size=16)
    run_recipe(assets, tmp_path / "run", "algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1",
               "actor_rollout_ref.rollout.do_sample=false", "data.max_response_length=12",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
               "trainer.test_freq=-1", "trainer.save_freq=-1", "actor_rollout_ref.rollout.reallocation.enable=true",
               "actor_rollout_ref.rollout.reallocation.slice_s=0.0001",
               "actor_rollout_ref.rollout.max_num_seqs=2")  # 4 samples per rank: 2 queued, which may move
    steps = read_steps(tmp_path / "run")
    assert sorted(steps) == [1]
    for step in steps.values():
        moved = step["rollout/reallocated_samples"]
        assert moved >= 0 and step["rollout/reallocations"] <= moved
        # per-rank means over the two ranks' sessions: each moved sample left one and reached the other
        assert 2 * step["rollout/stream_exported"] == 2 * step["rollout/stream_adopted"] == moved
        assert step["rollout/reallocated_prefix_tokens"] == 0  # only queued samples move by default
        assert math.isfinite(step["actor/pg_loss"]) and "perf/gen_tail_share" in step and "timing_s/gen_worker" in step
        assert step["rollout/dealt_by_length"] == 0.0  # deal_by_length: no prompt answered before the first step
