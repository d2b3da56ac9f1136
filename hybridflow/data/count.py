"""The long-tail workload: seeded synthetic counting ("count 137 to 141:" -> "137 138 139 140 141").

Every benchmark before it had answers of a few tokens, where training dominates a step. Reasoning RL
is generation-heavy with long-tailed answer lengths: most answers are short, a few are very long,
and the batch waits for the longest. This task reproduces that shape without a download, so the
systems that target it (asynchronous rollout, stage fusion, speculative rollout) are judged on it.

Numbers are 3-digit (100..999), so with the character tokenizer of ``hybridflow.tiny`` an answer of
``n`` numbers is exactly ``4n - 1`` tokens (plus EOS): the length profile is set by ``n`` alone.
``n`` is drawn from a mixture: with probability ``1 - tail_share`` uniformly from 1..``body_max``
(the short body), else from a power law ``P(n) ~ n**-tail_exponent`` on ``body_max+1..max_count``
(the long tail). One power law over the whole range cannot give both "80% at most 32 tokens" and
"5% at least 160 tokens" (fitting one gives the other at 3-4%), hence the mixture. The defaults
give 82% of answers at most 31 tokens, 5% at least 163, the longest 255 (+ EOS = 256).

Rows follow verl's schema, like the arithmetic task's (``hybridflow.data.arithmetic``); the reward
is ``hybridflow.rewards.count`` (data_source ``count``). Train and validation problems are distinct.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hybridflow.data.task_files import task_main, write_splits

DATA_SOURCE = "count"
LOW, HIGH = 100, 999  # every number has 3 digits: length in tokens is a function of the count alone
MAX_PROMPT_LENGTH = 24  # "count 100 to 163:" is 17 characters
MAX_RESPONSE_LENGTH = 256  # the longest answer, 64 numbers, is 255 characters + EOS


@dataclasses.dataclass
class CountTaskConfig:
    """Size and length profile of the counting task (the defaults are the benchmark's).

    ``body_max``: short answers hold 1..body_max numbers (8 -> at most 31 tokens).
    ``tail_share``: the fraction of problems drawn from the tail instead (0.18: a little under 20%,
    so the 80th percentile lands in the body, not on its edge).
    ``tail_exponent``: the tail's power law on body_max+1..max_count; 0.75 puts 28% of the tail
    (5% of all answers) at 41 numbers (163 tokens) or more.
    ``max_count``: the longest answer in numbers (64 -> 255 tokens, within a 256-token response).
    """

    train_size: int = 2048
    val_size: int = 128
    seed: int = 0
    body_max: int = 8
    tail_share: float = 0.18
    tail_exponent: float = 0.75
    max_count: int = 64

    def validate(self) -> None:
        if not 1 <= self.body_max < self.max_count:
            raise ValueError(f"count body_max={self.body_max}: use 1 <= body_max < max_count={self.max_count}")
        if answer_tokens(self.max_count) + 1 > MAX_RESPONSE_LENGTH:
            raise ValueError(f"count max_count={self.max_count}: its answer plus EOS exceeds "
                             f"{MAX_RESPONSE_LENGTH} tokens; use at most {MAX_RESPONSE_LENGTH // 4}")
        if not 0.0 <= self.tail_share <= 1.0:
            raise ValueError(f"count tail_share={self.tail_share}: use a fraction in [0, 1]")
        if self.train_size < 1 or self.val_size < 0:
            raise ValueError(f"count train_size={self.train_size}, val_size={self.val_size}: "
                             "train_size must be positive and val_size non-negative")


def answer_tokens(count: int) -> int:
    """Tokens of an answer of ``count`` 3-digit numbers in the character tokenizer (EOS excluded)."""
    return 4 * count - 1


def make_problem(start: int, count: int) -> tuple[str, str]:
    """Prompt text and answer of counting ``count`` numbers from ``start``."""
    end = start + count - 1
    return f"count {start} to {end}:", " ".join(str(k) for k in range(start, end + 1))


def sample_counts(config: CountTaskConfig, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` answer lengths in numbers, drawn from the body/tail mixture described above."""
    tail_values = np.arange(config.body_max + 1, config.max_count + 1)
    tail_p = tail_values.astype(float) ** -config.tail_exponent
    body = rng.integers(1, config.body_max + 1, size=size)
    tail = rng.choice(tail_values, size=size, p=tail_p / tail_p.sum())
    return np.where(rng.random(size) < config.tail_share, tail, body)


def _row(start: int, count: int, split: str, index: int) -> dict:
    prompt, answer = make_problem(start, count)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "counting",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": prompt, "answer": answer, "count": count},
    }


def generate_count(config: CountTaskConfig) -> tuple[list[dict], list[dict]]:
    """Seeded (train_rows, val_rows); the same config always yields the same rows.

    Each problem draws its length first, then its start uniformly among those that stay within 3
    digits (837 starts at 64 numbers, 900 at one), redrawing the start of a duplicate.
    """
    config.validate()
    rng = np.random.default_rng(config.seed)
    n_needed = config.train_size + config.val_size
    seen: set[tuple[int, int]] = set()
    chosen: list[tuple[int, int]] = []
    rounds = 0
    while len(chosen) < n_needed:
        rounds += 1
        if rounds > 100:  # only sizes near the pool's (about 55k problems) get here
            raise ValueError(f"count: could not draw {n_needed} distinct problems; lower train_size/val_size")
        for count in (int(c) for c in sample_counts(config, n_needed - len(chosen), rng)):
            # a duplicate redraws its start, not its length: redrawing the length would shift mass
            # from the short body (fewer distinct problems per length) to the tail
            for _ in range(100):
                start = int(rng.integers(LOW, HIGH - count + 2))
                if (start, count) not in seen:
                    seen.add((start, count))
                    chosen.append((start, count))
                    break
    train = [_row(s, c, "train", i) for i, (s, c) in enumerate(chosen[:config.train_size])]
    val = [_row(s, c, "val", i) for i, (s, c) in enumerate(chosen[config.train_size:])]
    return train, val


def write_count_parquet(out_dir: str, config: CountTaskConfig | None = None) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths.

    Seeded: the same config writes the same rows, so rewriting is harmless and callers may skip it
    when the files exist.
    """
    config = config or CountTaskConfig()
    return write_splits(out_dir, *generate_count(config))


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridflow.data.count OUT_DIR [--train-size 2048] [--seed 0] ...``"""
    task_main(CountTaskConfig, write_count_parquet, argv, main.__doc__)


if __name__ == "__main__":
    main()
