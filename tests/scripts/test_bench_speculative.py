"""The speculative bench's pure parts (scripts/bench/speculative.py): every mode it compares is a
speculative config the rollout accepts (vLLM's arguments built from it), and the summary's ratios
are tokens per second against the run without speculation, per epoch and over all calls."""
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
import speculative  # noqa: E402


def test_every_mode_is_a_config_vllm_gets():
    from hybridflow.config import load_config
    from workers.rollout.vllm_speculative import speculative_kwargs

    keys = set(vars(load_config({}).actor_rollout_ref.rollout.speculative))
    for mode, spec in speculative.MODES.items():
        settings = dict(speculative.SPEC_DEFAULTS, **spec) if spec else {}
        assert set(settings) <= keys, mode
        assert (speculative_kwargs(settings, 256) is None) == (mode == "off")


def test_summary_ratios_are_tokens_per_second_against_off():
    def run(*calls):
        return {"calls": [dict(epoch=e, seconds=s, tokens=t) for e, s, t in calls]}

    out = speculative.summarise({"off": run((0, 2.0, 100), (1, 2.0, 100)),
                                 "adaptive": run((0, 1.0, 60), (1, 1.0, 140))})
    assert out["off"]["tokens_per_s"] == 50.0
    assert out["adaptive"]["tokens_per_s_by_epoch"] == [60.0, 140.0]
    assert out["adaptive"]["ratio_tokens_per_s_vs_off"] == 2.0
    assert out["adaptive"]["ratio_by_epoch"] == [1.2, 2.8]


def test_summary_keeps_the_last_runs_table_and_step_costs():
    cost = {"c0": 4.1, "c1_per_token": 0.07, "c2_verify": 0.5, "c3_per_draft_pass": 1.5}
    first = {"calls": [dict(epoch=0, seconds=1.0, tokens=10)], "draft_table": [[1, 256, 0]]}
    last = {"calls": [dict(epoch=0, seconds=1.0, tokens=30)], "draft_table": [[1, 4, 4], [5, 256, 0]],
            "step_cost_ms": cost}
    out = speculative.summarise({"off": {"calls": [dict(epoch=0, seconds=2.0, tokens=20)]},
                                 "draft": [first, last]})
    assert out["draft"]["draft_table"] == [[1, 4, 4], [5, 256, 0]]
    assert out["draft"]["step_cost_ms"] == cost
    assert out["draft"]["ratio_tokens_per_s_vs_off"] == 2.0
    assert "step_cost_ms" not in out["off"]


def test_one_draft_model_a_process():
    from types import SimpleNamespace

    import pytest

    args = SimpleNamespace(modes="off,draft,pard", epochs=2, repeats=1, demo_epochs=30, demo_repeats=1)
    with pytest.raises(SystemExit, match="separate invocations"):
        speculative._plan("longtail", args)
    assert speculative._plan("longtail", SimpleNamespace(**{**vars(args), "modes": "off,pard"}))[0] == ["off", "pard"]
    # the demo has no draft model: both modes drop out there
    assert speculative._plan("demo", args)[0] == ["off"]
