"""Rule reward for the counting task of ``hybridflow.data.count`` (data_source ``count``).

The answer is a run of integers separated by whitespace ("137 138 139"). Partial credit for a
correct leading part is what makes the long answers learnable: a policy that counts 40 numbers
right before slipping earns most of the reward, instead of the same 0 as a policy that writes
nothing useful.
"""

from __future__ import annotations

import re

_LEADING_INT = re.compile(r"\s*(\d+)")
# what a decoder may leave after the answer: special-token text such as "</s>" or "<|im_end|>"
_SPECIAL = re.compile(r"<\|?[^<>\s]*\|?>")


def read_numbers(solution_str: str) -> tuple[list[int], bool]:
    """The response's leading run of integers, and whether other text follows it.

    The run starts at the response's first non-space character and stops at the first character
    that is not whitespace or a digit. Whitespace and special-token text ("</s>", "<|im_end|>")
    after the run do not count as other text.
    """
    numbers, pos = [], 0
    while (match := _LEADING_INT.match(solution_str, pos)) is not None:
        # "138abc": 138 is read, "abc" is trailing text; "1389" is one number, never 138
        numbers.append(int(match.group(1)))
        pos = match.end()
        if pos < len(solution_str) and not solution_str[pos].isspace():
            break
    rest = _SPECIAL.sub("", solution_str[pos:]).strip()
    return numbers, bool(rest)


def parse_ground_truth(ground_truth: object) -> list[int]:
    words = str(ground_truth).split()
    if not words or not all(w.isdigit() for w in words):
        raise ValueError(f"count ground_truth must be integers separated by spaces, got {ground_truth!r}")
    return [int(w) for w in words]


def compute_score(solution_str: str, ground_truth: object) -> float:
    """1.0 for the exact answer; else ``k / max(n, m)``, 0.0 for a response that starts with no integer.

    ``n``: the numbers in the correct answer. ``m``: the numbers in the response's leading run
    (``read_numbers``), plus one when other text follows the run. ``k``: how many of the run's
    first numbers equal the answer's first numbers, in order (the correct leading run).

    So a response that stops early scores the fraction of the answer it got right ("137 138" for
    "137 138 139 140": 0.5), a wrong number ends the credit there ("137 999 139 140": 0.25), and
    writing past the end costs like a wrong number ("137 138 139" for "137 138": 2/3), so 1.0 is
    reached only by the exact answer. Trailing whitespace and special-token text (EOS) are ignored.
    """
    # the ground truth first: a bad one must raise on every sample, as in arithmetic.py
    truth = parse_ground_truth(ground_truth)
    numbers, trailing = read_numbers(solution_str)
    k = 0
    for got, want in zip(numbers, truth):
        if got != want:
            break
        k += 1
    m = len(numbers) + int(trailing)
    return k / max(len(truth), m)
