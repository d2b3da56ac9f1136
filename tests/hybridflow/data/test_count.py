import numpy as np
import pandas as pd
import pytest

from hybridflow.data.count import (MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, CountTaskConfig, generate_count, main,
                                   write_count_parquet)
from hybridflow.data.dataset import RLPromptDataset
from hybridflow.rewards.registry import default_compute_score


def answer_lengths(rows, tokenizer) -> np.ndarray:
    return np.array([len(tokenizer(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"])
                     for r in rows])


def test_seeded_length_profile_of_the_default_train_set(char_tokenizer):
    train, _ = generate_count(CountTaskConfig())
    lengths = answer_lengths(train, char_tokenizer)
    p50, p80, p95 = np.percentile(lengths, [50, 80, 95])
    # measured at seed 0: p50 23, p80 31, p95 155, max 251, 81% <= 32, 4.3% >= 160 tokens
    assert 15 <= p50 <= 27 and p80 <= 32 and 120 <= p95 <= 200
    assert 0.77 <= (lengths <= 32).mean() <= 0.86
    assert 0.03 <= (lengths >= 160).mean() <= 0.07
    assert lengths.max() + 1 <= MAX_RESPONSE_LENGTH  # + EOS
    counts = np.array([r["extra_info"]["count"] for r in train])
    assert (lengths == 4 * counts - 1).all()  # 3-digit numbers: the length is the count's alone


def test_same_seed_same_rows_other_seed_other_rows():
    cfg = dict(train_size=100, val_size=20)
    assert generate_count(CountTaskConfig(**cfg, seed=3)) == generate_count(CountTaskConfig(**cfg, seed=3))
    assert generate_count(CountTaskConfig(**cfg, seed=3))[0] != generate_count(CountTaskConfig(**cfg, seed=4))[0]


def test_rows_are_correct_distinct_and_in_verl_schema():
    train, val = generate_count(CountTaskConfig(train_size=300, val_size=50, seed=1))
    assert len(train) == 300 and len(val) == 50
    prompts = [r["prompt"][0]["content"] for r in train + val]
    assert len(set(prompts)) == 350  # validation problems are unseen in training
    for split, rows in (("train", train), ("val", val)):
        for i, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "count" and row["prompt"][0]["role"] == "user"
            start, end = (int(x) for x in row["prompt"][0]["content"][len("count "):-1].split(" to "))
            assert row["reward_model"]["ground_truth"] == " ".join(map(str, range(start, end + 1)))
            assert 100 <= start <= end <= 999
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            # the rule reward reads this data_source and scores its own answer 1.0
            assert default_compute_score(row["data_source"], row["reward_model"]["ground_truth"],
                                         row["reward_model"]["ground_truth"]) == 1.0


def test_invalid_settings_fail_with_the_setting_named():
    with pytest.raises(ValueError, match="max_count=65"):
        generate_count(CountTaskConfig(max_count=65))
    with pytest.raises(ValueError, match="body_max=0"):
        generate_count(CountTaskConfig(body_max=0))
    with pytest.raises(ValueError, match="tail_share=1.5"):
        generate_count(CountTaskConfig(tail_share=1.5))


def test_parquet_files_in_verl_schema_read_by_the_dataset(tmp_path, char_tokenizer):
    train_path, val_path = write_count_parquet(str(tmp_path), CountTaskConfig(train_size=30, val_size=10))
    assert write_count_parquet(str(tmp_path), CountTaskConfig(train_size=30, val_size=10)) == (train_path, val_path)
    frame = pd.read_parquet(train_path)
    assert len(frame) == 30 and len(pd.read_parquet(val_path)) == 10
    assert list(frame.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    ds = RLPromptDataset(val_path, char_tokenizer, max_prompt_length=MAX_PROMPT_LENGTH, apply_chat_template=False)
    _, val = generate_count(CountTaskConfig(train_size=30, val_size=10))
    assert len(ds) == 10
    for i in range(10):
        text = char_tokenizer.decode(ds[i]["input_ids"][ds[i]["attention_mask"].bool()].tolist())
        assert text == val[i]["prompt"][0]["content"]
        assert ds[i]["ground_truth"] == val[i]["reward_model"]["ground_truth"]


def test_command_line_writes_both_files(tmp_path, capsys):
    main([str(tmp_path), "--train-size", "20", "--val-size", "4", "--seed", "2"])
    assert "20 rows" in capsys.readouterr().out
    assert len(pd.read_parquet(tmp_path / "val.parquet")) == 4
