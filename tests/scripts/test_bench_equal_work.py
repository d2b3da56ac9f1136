"""e2e.py --best-precision's pure parts (scripts/bench/_equal_work.py): each side's faster dtype, the
ratio at equal work and its per-repeat spread, the goal by the CPU it ran as. No runs."""
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

import _equal_work  # noqa: E402

AVX2 = {"runs_as": ["avx2", "fma"]}
BF16 = {"runs_as": ["avx2", "fma", "avx512f", "avx512_bf16"]}


def test_each_side_takes_its_faster_dtype_and_the_goal_follows_the_cpu():
    runs = {"hybridflow_fp32": [{"step_s": 3.0}, {"step_s": 3.2}], "hybridflow_bf16": [{"step_s": 1.4}, {"step_s": 1.6}],
            "trl_fp32": [{"step_s": 4.0}, {"step_s": 4.4}], "trl_bf16": [{"step_s": 2.0}, {"error": "exited 1"}]}
    out = _equal_work.summarise(runs, "bf16", BF16)
    assert out["best"]["hybridflow"] == {"dtype": "bf16", "attn_implementation": "sdpa", "step_s": 1.5,
                                         "repeats_s": [1.4, 1.6]}
    assert out["best"]["trl"]["dtype"] == "bf16" and out["best"]["trl"]["step_s"] == 2.0  # the failed repeat left out
    assert out["ratio_to_trl_best_precision"] == 0.75 and out["goal"] == 0.7
    out = _equal_work.summarise({k: v for k, v in runs.items() if k.endswith("fp32")}, "fp32", AVX2)
    assert out["ratio_per_repeat"] == [0.75, 0.727] and out["goal"] == 0.8


def test_each_side_takes_its_faster_attention_and_the_same_setting_ratios_are_kept():
    runs = {"hybridflow_bf16_sdpa": [{"step_s": 1.2}], "trl_bf16_sdpa": [{"step_s": 1.5}],
            "hybridflow_bf16_eager": [{"step_s": 1.0}], "trl_bf16_eager": [{"step_s": 1.6}]}
    out = _equal_work.summarise(runs, "bf16", BF16)
    assert (out["best"]["hybridflow"]["attn_implementation"], out["best"]["trl"]["attn_implementation"]) == (
        "eager", "sdpa")  # the baseline keeps its own faster attention
    assert out["ratio_to_trl_best_precision"] == 0.667
    assert out["ratio_same_setting"] == {"bf16/eager": 0.625, "bf16/sdpa": 0.8}


def test_a_side_without_a_result_gives_no_ratio():
    out = _equal_work.summarise({"hybridflow_fp32": [{"step_s": 3.0}], "trl_fp32": [{"error": "x"}]}, "fp32", AVX2)
    assert "ratio_to_trl_best_precision" not in out and out["best"]["hybridflow"]["step_s"] == 3.0


def test_the_forced_avx2_switch_is_what_the_cpu_runs_as(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CPU_ISA", "avx2")
    cpu = _equal_work.cpu_in_hand()
    assert cpu["runs_as"] == ["avx2", "fma"] and cpu["HYBRIDFLOW_CPU_ISA"] == "avx2"
