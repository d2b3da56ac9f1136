"""The embedded default task: seeded synthetic integer arithmetic ("12+7=" -> "19").

Every run of hybridflow works without a download, so the demo and the recipe smoke tests train on
this task. Rows follow verl's prompt-dataset schema (``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model.ground_truth``, ``extra_info``) so the same loader, reward registry and
trainer serve it and any user data set.

Prompts are deliberately short and space-free ("a+b="): with the character tokenizer of
``hybridflow.tiny`` each character is one token, so a 2-digit problem is 6 prompt tokens and its
answer at most 3 tokens plus EOS.

Train and validation problems are drawn without replacement from one pool, so validation accuracy
measures generalisation to unseen operand pairs, not recall of training rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hybridflow.data.task_files import task_main, write_splits

DATA_SOURCE = "arithmetic"
OPERATORS = "+-"


@dataclasses.dataclass
class ArithmeticTaskConfig:
    """Difficulty and size of the synthetic task.

    ``digits``: operands are uniform integers in ``[0, 10**digits)``.
    ``operators``: a subset of ``"+-"``; each problem picks one uniformly. Subtraction orders its
    operands so the answer is never negative (a minus sign would be a second output format).
    """

    digits: int = 2
    operators: str = "+"
    train_size: int = 2048
    val_size: int = 256
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.digits <= 6:
            raise ValueError(f"arithmetic digits={self.digits}: use an integer from 1 to 6")
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(
                f"arithmetic operators={self.operators!r}: use a non-empty subset of {OPERATORS!r}")
        pool = len(set(self.operators)) * (10 ** self.digits) ** 2
        if self.train_size < 1 or self.val_size < 0 or self.train_size + self.val_size > pool:
            raise ValueError(
                f"arithmetic train_size={self.train_size} + val_size={self.val_size} must be "
                f"positive and at most {pool} distinct problems for digits={self.digits}, "
                f"operators={self.operators!r}: lower the sizes or raise digits")


def make_problem(a: int, b: int, op: str) -> tuple[str, str]:
    """Prompt text and answer string of one problem (subtraction ordered to be non-negative)."""
    if op == "-" and a < b:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(answer)


def _row(a: int, b: int, op: str, split: str, index: int) -> dict:
    prompt, answer = make_problem(a, b, op)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": prompt, "answer": answer},
    }


def generate_arithmetic(config: ArithmeticTaskConfig) -> tuple[list[dict], list[dict]]:
    """Seeded (train_rows, val_rows); the same config always yields the same rows.

    Distinct problems are sampled from the pool (operator, a, b) without replacement, then split;
    for subtraction (a, b) and (b, a) are the same problem, so duplicates are removed by prompt.
    """
    config.validate()
    ops = sorted(set(config.operators), key=OPERATORS.index)
    rng = np.random.default_rng(config.seed)
    n_needed = config.train_size + config.val_size
    base = 10 ** config.digits
    seen: set[str] = set()
    chosen: list[tuple[int, int, str]] = []
    # Rejection sampling on distinct prompts; pools are far larger than the sizes used in
    # practice, and the validate() bound keeps this from looping forever except for subtraction
    # pools close to full, which we guard with an attempt cap.
    attempts = 0
    while len(chosen) < n_needed:
        attempts += 1
        if attempts > 50 * n_needed + 10_000:
            raise ValueError(
                f"arithmetic: could not draw {n_needed} distinct problems with digits="
                f"{config.digits}, operators={config.operators!r}: lower train_size/val_size")
        op = ops[int(rng.integers(len(ops)))]
        a, b = (int(x) for x in rng.integers(0, base, size=2))
        prompt, _ = make_problem(a, b, op)
        if prompt in seen:
            continue
        seen.add(prompt)
        chosen.append((a, b, op))
    train = [_row(a, b, op, "train", i) for i, (a, b, op) in enumerate(chosen[:config.train_size])]
    val = [_row(a, b, op, "val", i) for i, (a, b, op) in enumerate(chosen[config.train_size:])]
    return train, val


def write_arithmetic_parquet(out_dir: str, config: ArithmeticTaskConfig | None = None
                             ) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths."""
    config = config or ArithmeticTaskConfig()
    return write_splits(out_dir, *generate_arithmetic(config))


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridflow.data.arithmetic OUT_DIR [--digits 2] [--operators +-] ...``"""
    task_main(ArithmeticTaskConfig, write_arithmetic_parquet, argv, main.__doc__)


if __name__ == "__main__":
    main()
