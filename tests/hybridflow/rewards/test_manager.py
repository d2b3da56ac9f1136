import logging
import pickle
import textwrap

import pytest
import torch

from hybridflow.rewards import RewardFunctionError, RewardManager, load_reward_function, make_reward_manager


def test_scores_land_on_last_response_token():
    manager = RewardManager()
    out = manager(
        responses=["1 + 1 = 2", "2 * 3 = 5", "#### 72"],
        response_lengths=torch.tensor([4, 2, 3]),
        max_response_length=5,
        data_sources=["arithmetic", "arithmetic", "openai/gsm8k"],
        ground_truths=["2", "6", "72"],
    )
    expected = torch.zeros(3, 5)
    expected[0, 3] = 1.0
    expected[2, 2] = 1.0
    assert torch.equal(out.token_level_scores, expected)
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.metrics["reward/errors"] == 0.0
    assert out.metrics["reward/score/mean"] == pytest.approx(2 / 3)
    assert out.metrics["reward/score/arithmetic/mean"] == pytest.approx(0.5)
    assert out.metrics["reward/score/openai/gsm8k/mean"] == pytest.approx(1.0)


def test_raising_reward_function_is_counted_not_fatal(caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise RuntimeError("parser exploded")
        return 1.0

    manager = RewardManager(flaky, max_logged_errors=2)
    responses = ["ok", "boom", "boom", "ok", "boom"]
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        out = manager(responses, [1] * 5, 2, ["s"] * 5, [None] * 5)
    assert out.scores == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert out.metrics["reward/errors"] == 3.0
    messages = [r.getMessage() for r in caplog.records]
    assert any("sample 1" in m and "parser exploded" in m for m in messages)
    assert any("sample 2" in m for m in messages)
    assert not any("sample 4" in m for m in messages)  # only the first two are logged
    assert any("only counted in reward/errors" in m for m in messages)


def test_reward_function_raising_on_every_sample_stops_the_run():
    """Broken, not flaky: all-zero scores would train on nothing, so once 8 samples in a row (whole
    batches) raised, the batch raises, naming the first exception. Smaller all-raising batches are
    counted until then, and one success starts the count again."""
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "ok":
            return 1.0
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match=r"raised on all 8 samples of a batch, first KeyError: 'answer'"):
        RewardManager(broken)(["a"] * 8, [1] * 8, 1, ["d"] * 8, [0] * 8)
    manager = RewardManager(broken)
    for _ in range(2):
        assert manager(["a", "b", "c"], [1] * 3, 1, ["d"] * 3, [0] * 3).metrics["reward/errors"] == 3.0
    assert manager(["a", "ok"], [1] * 2, 1, ["d"] * 2, [0] * 2).scores == [0.0, 1.0]  # flaky: the count restarts
    for _ in range(2):
        manager(["a", "b", "c"], [1] * 3, 1, ["d"] * 3, [0] * 3)
    with pytest.raises(RewardFunctionError, match=r"raised on all 3 samples of a batch \(9 in a row\)"):
        manager(["a", "b", "c"], [1] * 3, 1, ["d"] * 3, [0] * 3)


def test_malformed_results_are_errors_and_dict_extras_become_metrics():
    results = iter([{"score": 1.0, "acc": True, "pred": "7"}, {"acc": 0.0}, float("nan"), "high",
                    {"score": 0.5, "acc": False}])

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return next(results)

    out = RewardManager(scorer)(["a"] * 5, [1] * 5, 1, ["d"] * 5, [0] * 5)
    assert out.scores == [1.0, 0.0, 0.0, 0.0, 0.5]
    assert out.metrics["reward/errors"] == 3.0
    assert out.extra == {"acc": [True, None, None, None, False], "pred": ["7", None, None, None, None]}
    assert out.metrics["reward/acc/mean"] == pytest.approx(0.5)
    assert "reward/pred/mean" not in out.metrics


def test_extra_info_is_passed_per_sample():
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.0

    RewardManager(scorer)(["a", "b"], [1, 1], 1, ["d", "d"], [1, 2], extra_infos=[{"i": 0}, {"i": 1}])
    assert seen == [{"i": 0}, {"i": 1}]


def test_batch_shape_errors():
    manager = RewardManager()
    with pytest.raises(ValueError, match="ground_truths has 1 entries for 2 responses"):
        manager(["a", "b"], [1, 1], 2, ["arithmetic"] * 2, ["1"])
    with pytest.raises(ValueError, match="max_response_length=2"):
        manager(["a"], [3], 2, ["arithmetic"], ["1"])


def test_unknown_data_source_is_counted_as_error():
    out = RewardManager()(["= 1"], [1], 1, ["math500"], ["1"])
    assert out.scores == [0.0] and out.metrics["reward/errors"] == 1.0


USER_FILE = textwrap.dedent(
    """
    def my_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        return {"score": float(solution_str.strip() == ground_truth) + bonus, "length": len(solution_str)}

    helper_value = 3
    """
)


def test_custom_reward_function_by_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    manager = make_reward_manager(str(path), "my_reward", reward_kwargs={"bonus": 0.5})
    out = manager(["yes", "no "], [2, 3], 4, ["custom", "custom"], ["yes", "yes"])
    assert out.scores == [1.5, 0.5]
    assert out.extra["length"] == [3, 3]
    assert out.token_level_scores[0, 1].item() == 1.5 and out.token_level_scores[1, 2].item() == 0.5
    # shipped to Ray workers by value: works without the file on their import path
    cloudpickle = pytest.importorskip("cloudpickle")
    fn = load_reward_function(str(path), "my_reward")
    clone = pickle.loads(cloudpickle.dumps(fn))
    assert clone("d", "a", "a")["score"] == 1.0


def test_custom_reward_function_errors(tmp_path):
    with pytest.raises(RewardFunctionError, match="custom_reward_function.path: no such file"):
        load_reward_function(str(tmp_path / "missing.py"))
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    with pytest.raises(RewardFunctionError) as err:
        load_reward_function(str(path), "compute_score")
    assert "custom_reward_function.name" in str(err.value) and "['my_reward']" in str(err.value)
    with pytest.raises(RewardFunctionError, match="'helper_value' is not callable"):
        load_reward_function(str(path), "helper_value")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(RewardFunctionError, match="importing .*broken.py.* raised ModuleNotFoundError"):
        load_reward_function(str(broken))


BATCH_FILE = textwrap.dedent(
    """
    CALLS = []

    def batch_reward(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        CALLS.append(len(solution_strs))
        return [{"score": float(s.strip() == g) + bonus, "src": d} if i != 2 else "malformed"
                for i, (d, s, g) in enumerate(zip(data_sources, solution_strs, ground_truths))]
    """
)


def test_batch_manager_calls_once_per_batch_with_lists(tmp_path):
    """reward_model.reward_manager=batch (verl's BatchRewardManager): one call with lists; each
    result is checked as a per-sample one (a malformed entry scores 0 and is counted)."""
    path = tmp_path / "batch_reward.py"
    path.write_text(BATCH_FILE)
    manager = make_reward_manager(str(path), "batch_reward", {"bonus": 0.5}, manager="batch")
    out = manager(["1", "2 ", "3", "4"], [1, 2, 1, 1], 2, ["a", "b", "c", "d"], ["1", "0", "3", "4"],
                  extra_infos=[{}, {}, {}, {}])
    assert out.scores == [1.5, 0.5, 0.0, 1.5]
    assert out.metrics["reward/errors"] == 1.0 and out.extra["src"] == ["a", "b", None, "d"]
    assert manager.compute_score.func.__globals__["CALLS"] == [4]


def test_batch_manager_errors_name_the_fix(tmp_path):
    def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    def raises(data_sources, solution_strs, ground_truths, extra_infos):
        raise TimeoutError("sandbox")

    with pytest.raises(RewardFunctionError, match="returned 1 results for 2 responses"):
        RewardManager(wrong_length, batched=True)(["a", "b"], [1, 1], 1, ["d", "d"], [0, 0])
    with pytest.raises(RewardFunctionError, match="batch reward function raised TimeoutError: sandbox"):
        RewardManager(raises, batched=True)(["a", "b"], [1, 1], 1, ["d", "d"], [0, 0])
    with pytest.raises(RewardFunctionError, match="set custom_reward_function.path"):
        make_reward_manager(None, manager="batch")
    with pytest.raises(ValueError, match="reward_manager='prime' is unknown"):
        make_reward_manager(None, manager="prime")
    scores = RewardManager(lambda **kw: torch.tensor([0.25, 1.0]), batched=True)(["a", "b"], [1, 1], 1,
                                                                                  ["d", "d"], [0, 0]).scores
    assert scores == [0.25, 1.0]  # a tensor of scores is a sequence too


def test_dapo_manager_adds_the_soft_overlong_penalty():
    """DAPO eq. 13 with factor 0.5: nothing up to max_length - buffer = 6 tokens, then linear to
    -0.5 at the maximum 10; the penalty lands in the score on the last token."""
    from hybridflow.rewards.manager import overlong_penalty

    manager = make_reward_manager(None, manager="dapo", overlong_buffer=(4, 0.5))
    lengths = [3, 6, 8, 10]
    out = manager(["= 2"] * 4, lengths, 10, ["arithmetic"] * 4, ["2"] * 4)
    assert out.scores == [1.0, 1.0, 0.75, 0.5]
    assert out.token_level_scores[2, 7].item() == 0.75
    assert out.metrics["reward/overlong/frac"] == 0.5
    assert out.metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.75 / 4)
    # per sample, verl's names, and the score before the penalty (validation shows it as val/task_score)
    assert out.extra["task_score"] == [1.0] * 4 and out.extra["overlong_reward"] == [0.0, 0.0, -0.25, -0.5]
    assert out.extra["overlong"] == [False, False, True, True]
    assert overlong_penalty(10, 10, 10, 1.0) == -1.0 and overlong_penalty(0, 10, 10, 1.0) == 0.0
    with pytest.raises(ValueError, match="set reward_model.reward_manager=dapo"):
        make_reward_manager(None, overlong_buffer=(4, 0.5))


def test_a_function_that_cannot_take_the_managers_arguments_is_refused_when_loaded(tmp_path):
    """verl's managers call compute_score with keywords; a function without extra_info used to
    pass the start-up checks and fail at the first scored batch, after Ray had started."""
    path = tmp_path / "no_extra_info.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth):\n    return 1.0\n"
                    "def by_kwargs(**kwargs):\n    return 1.0\n")
    with pytest.raises(RewardFunctionError, match=r"compute_score\(data_source, solution_str, ground_truth\) cannot be "
                                                  r"called as compute_score\(data_source, solution_str, ground_truth, "
                                                  r"extra_info\).*extra_info=None if unused"):
        make_reward_manager(str(path), "compute_score")
    assert make_reward_manager(str(path), "by_kwargs") is not None
    with pytest.raises(RewardFunctionError, match="as reward_model.reward_manager=batch calls it"):
        make_reward_manager(str(tmp_path / "no_extra_info.py"), "compute_score", manager="batch")
    # per-sample names under the batch manager are refused too; the batch file's function passes
    batch = tmp_path / "batch_reward.py"
    batch.write_text(BATCH_FILE)
    assert make_reward_manager(str(batch), "batch_reward", manager="batch") is not None
    with pytest.raises(RewardFunctionError, match="cannot be called as batch_reward\\(data_source,"):
        make_reward_manager(str(batch), "batch_reward")
