"""The planner bench's pure parts (scripts/bench/planner.py): Spearman's rank correlation, the
chosen-over-best ratio, and which predicted plans it measures."""
import os
import sys
from types import SimpleNamespace

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
import planner  # noqa: E402


def test_spearman():
    assert planner.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert planner.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # monotone but not linear: ranks only
    assert planner.spearman([1, 2, 3, 4, 5], [1, 4, 9, 16, 1000]) == pytest.approx(1.0)
    # one swapped pair of 5: 1 - 6 * 2 / (5 * 24) = 0.9
    assert planner.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    # ties get their mean rank (scipy.stats.spearmanr([1, 2, 2, 3], [1, 2, 3, 4]) = 0.9487)
    assert planner.rank([5, 1, 5, 3]) == [3.5, 1.0, 3.5, 2.0]
    assert planner.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.948683, abs=1e-6)
    with pytest.raises(ValueError):
        planner.spearman([1], [1])


def test_chosen_over_best():
    # the plan predicted fastest measured 10% slower than the best measured
    assert planner.chosen_over_best([1.0, 2.0, 3.0], [2.2, 2.0, 3.0]) == pytest.approx(1.1)
    assert planner.chosen_over_best([3.0, 1.0], [5.0, 4.0]) == 1.0


def _cand(step, placement, actor="a", critic="c", tp=1):
    plan = SimpleNamespace(placement=placement, layouts={"actor": actor, "critic": critic},
                           rollout=SimpleNamespace(tp=tp))
    return SimpleNamespace(estimate=SimpleNamespace(step_s=step, plan=plan))


def test_pick_measures_the_choice_every_placement_and_a_spread():
    cands = [_cand(1.0, "colocate"), _cand(1.0, "colocate"),  # same signature: one measured
             _cand(1.1, "colocate", tp=2), _cand(1.2, "colocate", actor="m"), _cand(1.3, "colocate", critic="m"),
             _cand(1.4, "colocate", actor="s"), _cand(2.0, "separate"), _cand(3.0, "colocate+rm-pool")]
    picked = planner.pick(cands, 4)
    assert len(picked) == 4
    assert picked[0] is cands[0]
    assert {c.estimate.plan.placement for c in picked} == {"colocate", "separate", "colocate+rm-pool"}
    assert [c.estimate.step_s for c in picked] == sorted(c.estimate.step_s for c in picked)
    assert len(planner.pick(cands, 10)) == 7  # every distinct signature


def test_summary_ranks_by_each_plans_fastest_step_and_its_median():
    rows = [{"predicted_step_s": 1.0, "measured_step_times_s": [3.0, 9.0, 8.0]},  # a slow spell
            {"predicted_step_s": 2.0, "measured_step_times_s": [4.0, 4.1, 4.2]},
            {"predicted_step_s": 3.0, "measured_step_times_s": [5.0, 5.0, 5.1]}]
    out = planner.summary(rows)
    assert [r["measured_step_s"] for r in rows] == [3.0, 4.0, 5.0]
    assert [r["measured_median_step_s"] for r in rows] == [8.0, 4.1, 5.0]
    assert out["spearman"] == pytest.approx(1.0) and out["chosen_over_best"] == 1.0
    assert out["spearman_median"] == pytest.approx(-0.5) and out["chosen_over_best_median"] == round(8.0 / 4.1, 3)
    assert out["plans_measured"] == 3
