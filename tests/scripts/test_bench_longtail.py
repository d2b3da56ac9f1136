"""The long-tail bench's pure parts (scripts/bench/longtail.py and the TRL baseline it runs): the
summary of our metrics records, TRL's tail share estimated from lengths, the step ratios and the
dtype read from the recipe's stderr. No runs: these decide the figures docs/benchmarks.md quotes."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

import e2e  # noqa: E402
import longtail  # noqa: E402
import trl_grpo_baseline as trl_baseline  # noqa: E402


def _record(step, gen, total, p50, p80, p95, tail, idle):
    return {"step": step, "timing_s/gen": gen, "timing_s/update_actor": total - gen, "timing_s/step": total,
            "perf/total_num_tokens": 1000.0, "response_length/mean": 40.0, "response_length/max": 200.0,
            "response_length/p50": p50, "response_length/p80": p80, "response_length/p95": p95,
            "perf/gen_tail_share": tail, "perf/idle_frac/main": idle, "critic/score/mean": 0.5}


def test_summary_takes_medians_after_warmup():
    # step 1 is warm-up (huge); steps 2..4 are measured
    records = [_record(1, 90.0, 100.0, 99, 99, 99, 0.9, 0.9), _record(2, 6.0, 10.0, 20, 30, 150, 0.5, 0.1),
               _record(3, 8.0, 10.0, 24, 32, 160, 0.6, 0.2), _record(4, 7.0, 20.0, 22, 31, 155, 0.7, 0.3)]
    out = e2e.summarise(records, warmup=1, prompts=16, samples=8)
    assert out["steps_measured"] == 3 and out["step_s"] == 10.0 and out["timing_s"]["gen"] == 7.0
    assert out["gen_share"] == 0.7  # median gen / median step, not a median of per-step shares
    assert out["response_length"] == {"p50": 22.0, "p80": 31.0, "p95": 155.0, "max": 200.0, "mean": 40.0}
    assert out["gen_tail_share"] == 0.6 and out["idle_frac"] == {"main": 0.2}
    assert out["tokens_per_s"] == 100.0


def test_trl_tail_estimate_from_lengths():
    # generate decodes until the longest ends: 200 steps; the median ended at 20, so 90% is the tail
    assert trl_baseline.tail_share_estimate([10, 20, 30, 200]) == pytest.approx((200 - 25) / 200)
    assert trl_baseline.tail_share_estimate([16, 16, 16]) == 0.0
    assert trl_baseline.length_stats([1, 2, 3, 4, 5]) == {"p50": 3.0, "p80": 4.2, "p95": 4.8, "max": 5.0}


def test_trl_length_summary_is_the_median_of_per_step_figures():
    steps = [{"lengths": [10, 10, 100]}, {"lengths": [20, 20, 40]}, {"lengths": [30, 30, 30]}]
    out = trl_baseline.summarise_lengths(steps)
    assert out["completion_length"]["p50"] == 20.0 and out["completion_length"]["max"] == 40.0
    assert out["gen_tail_share_est_from_lengths"] == 0.5  # tails 0.9, 0.5, 0.0
    assert trl_baseline.summarise_lengths([{}]) == {}


def test_ratios_and_resolved_dtype():
    results = {"every_row": {"step_s": 30.0}, "default": {"step_s": 15.0}, "trl": {"step_s": 60.0}}
    assert longtail.ratios(results, "trl") == {"ratio_step_ours_over_trl": 0.5,
                                               "ratio_step_ours_default_over_trl": 0.25}
    assert longtail.ratios({"every_row": {"error": "x"}, "trl": {"step_s": 1.0}}, "trl") == {}
    stderr = "noise\nparam_dtype=auto -> bf16: bf16 matmuls run 4.6x faster than fp32 on this CPU\n"
    assert longtail.resolved_dtype(stderr, []) == "bf16"
    assert longtail.resolved_dtype("", ["actor_rollout_ref.actor.param_dtype=fp32"]) == "fp32"


def test_recipe_overrides_keep_the_default_layout():
    args = longtail.parse_args([])
    overrides = longtail.recipe_overrides(args, {"model": "/m", "data": "/d"})
    assert not any(o.split("=")[0].endswith(("param_dtype", "fsdp_size", "placement")) for o in overrides)
    assert "actor_rollout_ref.rollout.n=8" in overrides and "data.train_batch_size=16" in overrides
    # micro-batch sizes are ours by default, and set by --micro-batch
    assert not any("micro_batch_size" in o for o in overrides)
    args = longtail.parse_args(["--micro-batch", "16"])
    overrides = longtail.recipe_overrides(args, {"model": "/m", "data": "/d"})
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16" in overrides
