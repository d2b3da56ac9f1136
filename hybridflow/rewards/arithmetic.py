"""Rule reward for integer arithmetic answers.

Format the model is expected to produce: any text whose answer is the integer written after the
LAST '=' sign (e.g. "3 + 4 = 7", "x = -12."). When the text after the last '=' holds no integer
(or there is no '='), the LAST integer anywhere in the response is the answer ("The answer is
7"). Integers are written in plain ASCII digits with an optional leading '-'; thousands
separators are not understood ("1,000" reads as 000 -> 0).

Score: 1.0 when the answer equals the ground truth as an integer, else 0.0 (also 0.0 when the
response holds no integer). The ground truth may be an int or a string like "7" / " -3 " / "7.0";
anything else is a dataset error and raises ValueError.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def extract_answer(solution_str: str) -> int | None:
    """The integer answer of a response by the rule above, or None when there is none."""
    if "=" in solution_str:
        after = _INT.search(solution_str.rsplit("=", 1)[1])
        if after is not None:
            return int(after.group())
    numbers = _INT.findall(solution_str)
    return int(numbers[-1]) if numbers else None


def parse_ground_truth(ground_truth: object) -> int:
    if isinstance(ground_truth, bool):
        raise ValueError(f"arithmetic ground_truth must be an integer, got bool {ground_truth!r}")
    if isinstance(ground_truth, int):
        return ground_truth
    try:
        value = float(str(ground_truth).strip())
    except ValueError:
        raise ValueError(
            f"arithmetic ground_truth must be an integer (int or numeric string), got {ground_truth!r}"
        ) from None
    if not value.is_integer():
        raise ValueError(f"arithmetic ground_truth must be a whole number, got {ground_truth!r}")
    return int(value)


def compute_score(solution_str: str, ground_truth: object) -> float:
    # the ground truth first: a bad one must raise on every sample (the reward manager then stops
    # the run), not only on those whose response happens to hold an integer
    truth = parse_ground_truth(ground_truth)
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == truth else 0.0
