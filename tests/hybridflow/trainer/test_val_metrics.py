"""Validation metrics with n samples per prompt, against values worked out by hand."""
import pytest

from hybridflow.trainer.val_metrics import validation_metrics


def test_one_sample_per_prompt_logs_means_only():
    out = validation_metrics([1.0, 0.0, 1.0], ["a", "b", "a"], n=1)
    assert out == {"val/score/mean": pytest.approx(2 / 3), "val/score/a/mean": 1.0, "val/score/b/mean": 0.0}


def test_per_prompt_statistics_by_hand():
    # prompt 1 (source a): 1, 0, 0; prompt 2 (a): 1, 1, 1; prompt 3 (b): 0, 0, 0.5
    scores = [1, 0, 0, 1, 1, 1, 0, 0, 0.5]
    sources = ["a"] * 6 + ["b"] * 3
    preds = ["7", "8", "8", "3", "3", "3", "1", "2", "5"]  # prompt 3: no majority, the first answer wins
    out = validation_metrics(scores, sources, n=3, extra={"pred": preds, "acc": [s == 1 for s in scores],
                                                          "note": ["x"] * 9})
    assert out["val/score/mean@3"] == pytest.approx((1 / 3 + 1 + 1 / 6) / 3)
    assert out["val/score/best@3"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert out["val/score/worst@3"] == pytest.approx((0 + 1 + 0) / 3)
    assert out["val/score/maj@3"] == pytest.approx((0 + 1 + 0) / 3)  # "8" wins prompt 1 with score 0
    assert out["val/score/std@3"] == pytest.approx(((2 / 9) ** 0.5 + 0 + (1 / 18) ** 0.5) / 3)
    assert out["val/score/a/best@3"] == 1.0 and out["val/score/b/best@3"] == 0.5
    assert out["val/score/a/maj@3"] == 0.5 and out["val/score/b/mean@3"] == pytest.approx(1 / 6)
    assert out["val/score/mean"] == pytest.approx(out["val/score/mean@3"])
    # a numeric (here boolean) field of the reward's dict gets the same treatment; text fields do not
    assert out["val/acc/best@3"] == pytest.approx(2 / 3) and out["val/acc/b/mean"] == 0.0
    assert not any("note" in k or "pred" in k for k in out)


def test_no_pred_field_no_majority():
    out = validation_metrics([1, 0, 0, 0], ["a"] * 4, n=2)
    assert "val/score/maj@2" not in out and out["val/score/best@2"] == 0.5


def test_ragged_groups_are_refused():
    with pytest.raises(ValueError, match="n=2"):
        validation_metrics([1, 0, 1], ["a"] * 3, n=2)


def test_a_field_missing_on_some_samples_averages_the_rest():
    """The reward function raised on two samples (score 0, no acc): acc is averaged over the others."""
    acc = [1.0, None, 0.0, 1.0, None, None]
    out = validation_metrics([1, 0, 0, 1, 0, 0], ["a", "a", "a", "a", "b", "b"], n=2, extra={"acc": acc})
    assert out["val/acc/mean"] == pytest.approx(2 / 3)
    assert out["val/acc/best@2"] == pytest.approx(1.0)  # prompts 1 and 2; prompt 3 has no acc at all
    assert out["val/acc/a/mean"] == pytest.approx(2 / 3) and "val/acc/b/mean" not in out
    assert out["val/score/mean"] == pytest.approx(1 / 3)


def test_a_batch_without_a_field_leaves_none_for_its_rows():
    """A validation batch where the reward function raised on every sample has no acc column; the
    other batches' acc still counts."""
    from hybridflow.trainer.val_metrics import join_columns

    columns = join_columns([(2, {"acc": [1.0, 0.0], "pred": ["3", "4"]}), (2, {}), (1, {"acc": [1.0]})])
    assert columns == {"acc": [1.0, 0.0, None, None, 1.0], "pred": ["3", "4", None, None, None]}
    out = validation_metrics([1, 0, 0, 0, 1], ["a"] * 5, n=1, extra=columns)
    assert out["val/acc/mean"] == pytest.approx(2 / 3)
