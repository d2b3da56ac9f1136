"""What the synthetic tasks (arithmetic.py, count.py) share: their train/val parquet files, the SFT
pairs written beside them, and a command line whose flags are their config dataclass's fields."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable


def write_splits(out_dir: str, train: list[dict], val: list[dict]) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` (verl's schema, one dict per row) under
    ``out_dir``; returns their paths."""
    import pandas as pd  # only when files are written: generating rows needs none of it

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train), ("val", val)):
        path = os.path.join(out_dir, f"{name}.parquet")
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]


def write_sft_pairs(data_dir: str) -> None:
    """``sft_train.parquet`` and ``sft_val.parquet`` (columns ``prompt``, ``response``: the SFT
    recipe's) beside a task's RL files: each row's prompt and its ground-truth answer."""
    import pandas as pd

    for split in ("train", "val"):
        rows = pd.read_parquet(os.path.join(data_dir, f"{split}.parquet"))
        pairs = pd.DataFrame({"prompt": rows["prompt"], "response": [r["ground_truth"] for r in rows["reward_model"]]})
        pairs.to_parquet(os.path.join(data_dir, f"sft_{split}.parquet"), index=False)


def task_main(config_cls: type, write: Callable, argv: list[str] | None, description: str) -> None:
    """``OUT_DIR`` and one ``--flag`` per field of ``config_cls`` (its default, its type); calls
    ``write(out_dir, config)`` and says what it wrote."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir")
    defaults = config_cls()
    for field in dataclasses.fields(config_cls):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)),
                            default=getattr(defaults, field.name))
    args = parser.parse_args(argv)
    cfg = config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})
    train_path, val_path = write(args.out_dir, cfg)
    print(f"wrote {train_path} ({cfg.train_size} rows) and {val_path} ({cfg.val_size} rows)")
