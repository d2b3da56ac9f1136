"""The synthetic tasks' shared file writers (hybridflow/data/task_files.py)."""
import pandas as pd

from hybridflow.data.count import CountTaskConfig, write_count_parquet
from hybridflow.data.task_files import write_sft_pairs


def test_sft_pairs_are_the_task_prompts_and_answers(tmp_path):
    write_count_parquet(str(tmp_path), CountTaskConfig(train_size=16, val_size=4, seed=3))
    write_sft_pairs(str(tmp_path))
    for split, size in (("train", 16), ("val", 4)):
        rows = pd.read_parquet(tmp_path / f"{split}.parquet")
        pairs = pd.read_parquet(tmp_path / f"sft_{split}.parquet")
        assert list(pairs.columns) == ["prompt", "response"] and len(pairs) == size
        for (_, pair), (_, row) in zip(pairs.iterrows(), rows.iterrows()):
            assert list(pair["prompt"]) == list(row["prompt"])
            assert pair["response"] == row["extra_info"]["answer"]
            question = row["extra_info"]["question"]  # "count 137 to 141:"
            start, end = (int(w) for w in question.removeprefix("count ").rstrip(":").split(" to "))
            assert pair["response"].split() == [str(k) for k in range(start, end + 1)]
