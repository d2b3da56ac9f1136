"""Rule reward for GSM8K (Cobbe et al. 2021): the reference solution ends with "#### <number>".

Two extraction modes, as in verl:
  strict   - the answer is the number after the LAST "####" ("... so she has #### 18"); a
             response without "####" has no answer.
  flexible - the answer is the last number anywhere in the response.
Only the last 300 characters are searched (a degenerate long generation would otherwise make the
regex scan dominate reward time; the answer is at the end by format).

Differences from verl: numbers are compared by value after removing ',' and '$' and a trailing
'.', so "1,000", "1000.00" and "$1000" all match a ground truth of "1000"; verl compares strings.

Score: `score` (1.0) when correct; `format_score` (0.0) when an answer was found but is wrong;
0.0 when no answer was found.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_TAIL_CHARS = 300
_STRICT = re.compile(r"####\s*(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]+(?:\.[0-9]+)?")


def _normalise(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The raw answer string of a response, or None when the mode finds none."""
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
    elif method == "flexible":
        matches = _NUMBER.findall(tail)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return matches[-1] if matches else None


def compute_score(solution_str: str, ground_truth: object, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    truth = _normalise(str(ground_truth))  # first: a bad ground truth raises on every sample
    if truth is None:
        raise ValueError(f"gsm8k ground_truth must be a number, got {ground_truth!r}")
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if _normalise(answer) == truth else format_score
