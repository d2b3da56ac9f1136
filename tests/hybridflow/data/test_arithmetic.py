import pandas as pd
import pytest

from hybridflow.data.arithmetic import ArithmeticTaskConfig, generate_arithmetic, main, write_arithmetic_parquet
from hybridflow.data.dataset import RLPromptDataset


def solve(prompt: str) -> int:
    body = prompt.rstrip("=")
    op = "+" if "+" in body else "-"
    a, b = (int(x) for x in body.split(op))
    return a + b if op == "+" else a - b


def test_same_seed_same_rows_other_seed_other_rows():
    cfg = ArithmeticTaskConfig(train_size=100, val_size=20, seed=7)
    assert generate_arithmetic(cfg) == generate_arithmetic(ArithmeticTaskConfig(train_size=100, val_size=20, seed=7))
    assert generate_arithmetic(cfg)[0] != generate_arithmetic(ArithmeticTaskConfig(train_size=100, val_size=20, seed=8))[0]


@pytest.mark.parametrize("digits,ops", [(1, "+"), (2, "+"), (2, "+-"), (3, "-")])
def test_answers_are_correct_in_range_and_splits_disjoint(digits, ops):
    train, val = generate_arithmetic(ArithmeticTaskConfig(digits=digits, operators=ops,
                                                          train_size=60, val_size=20, seed=0))
    assert len(train) == 60 and len(val) == 20
    prompts = [r["prompt"][0]["content"] for r in train + val]
    assert len(set(prompts)) == 80  # no duplicates, so val is unseen in train
    for row in train + val:
        text = row["prompt"][0]["content"]
        assert row["data_source"] == "arithmetic" and row["prompt"][0]["role"] == "user"
        assert int(row["reward_model"]["ground_truth"]) == solve(text) >= 0
        operands = text.rstrip("=").replace("-", "+").split("+")
        assert all(0 <= int(x) < 10 ** digits for x in operands)
        assert text.endswith("=") and " " not in text  # short, one char per token
    used = {"+" if "+" in p else "-" for p in prompts}
    assert used == set(ops)


def test_invalid_settings_fail_with_the_setting_named():
    with pytest.raises(ValueError, match="operators='\\*'"):
        generate_arithmetic(ArithmeticTaskConfig(operators="*"))
    with pytest.raises(ValueError, match="digits=0"):
        generate_arithmetic(ArithmeticTaskConfig(digits=0))
    with pytest.raises(ValueError, match="at most 100 distinct problems"):
        generate_arithmetic(ArithmeticTaskConfig(digits=1, train_size=90, val_size=20))


def test_parquet_round_trip_through_the_dataset(tmp_path, char_tokenizer):
    train_path, val_path = write_arithmetic_parquet(str(tmp_path), ArithmeticTaskConfig(train_size=30, val_size=10))
    assert len(pd.read_parquet(train_path)) == 30 and len(pd.read_parquet(val_path)) == 10
    ds = RLPromptDataset(val_path, char_tokenizer, max_prompt_length=6, filter_overlong_prompts=False)
    _, val = generate_arithmetic(ArithmeticTaskConfig(train_size=30, val_size=10))
    for i in range(10):
        text = char_tokenizer.decode(ds[i]["input_ids"][ds[i]["attention_mask"].bool()].tolist())
        assert text == val[i]["prompt"][0]["content"]
        assert ds[i]["ground_truth"] == val[i]["reward_model"]["ground_truth"]


def test_command_line_writes_both_files(tmp_path, capsys):
    main([str(tmp_path), "--digits", "1", "--operators", "+-", "--train-size", "20", "--val-size", "4"])
    assert "20 rows" in capsys.readouterr().out
    assert len(pd.read_parquet(tmp_path / "val.parquet")) == 4
