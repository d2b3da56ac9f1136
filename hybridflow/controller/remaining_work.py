"""Sample reallocation's estimate of a generation rank's remaining work, in tokens, and the size of
the move that evens two ranks out (used by ``GenerationStream``, hybridflow/controller/stream.py).

Why tokens and not a count of unfinished samples: in a first epoch no answer's length is known,
and a count moved the busiest rank's waiting samples a few at a time (an even count is not even
work: the samples waiting behind long answers are, by the deal, likely long too), so the long ones
started late on their new rank and it finished last (docs/benchmarks.md, sample reallocation,
2026-11-30 night). Here a sample is judged by the answers of the prompts dealt to the same rank: a
rank whose samples have all run 20 tokens while none has ended is judged long, one whose answers
end short is judged short, although both hold as many samples. That assumes a rank's waiting
samples are like its running ones, as they are when a contiguous share of the data is long (one
source, a sorted dataset); where a deal is lopsided by chance only, the ranks' estimates agree and
little moves.

A rank reports, per unfinished sample, ``(row_index, tokens generated so far, max_tokens)``
(``VLLMStream.progress``); ``origin`` maps each row to the rank it was dealt to.
"""
from __future__ import annotations

from typing import Iterable

Progress = tuple[int, int, int]  # (row_index, tokens generated on any engine, the sample's max_tokens)


def mean_lengths(finished_tokens: list[int], finished_count: list[int], unfinished: Iterable[Progress],
                 origin: dict[int, int]) -> list[float]:
    """Per dealt rank, the expected answer length of its samples: every token they generated
    (ended or not) over the number that ended, the maximum-likelihood mean of an exponential length
    with the unfinished answers censored. Infinite while none has ended, so each sample counts as
    what its max_tokens leave: a mean of the tokens over max(ended, 1) made whichever rank had
    reported one more step look busier before any answer ended, and the first move went either way."""
    tokens = [float(t) for t in finished_tokens]
    for row, generated, _ in unfinished:
        tokens[origin[row]] += generated
    return [t / c if c else float("inf") for t, c in zip(tokens, finished_count)]


def remaining(progress: list[Progress], means: list[float], origin: dict[int, int]) -> list[float]:
    """Each sample's expected tokens still to generate: its dealt rank's mean length (an
    exponential's remaining length does not depend on how far it got), at most what its max_tokens
    leave, at least 1."""
    return [max(1.0, min(means[origin[row]], float(cap - generated))) for row, generated, cap in progress]


def move_count(progress: list[Progress], means: list[float], origin: dict[int, int], gap: float,
               move_started: bool) -> int:
    """How many of the busiest rank's movable samples (those with no token generated, or any with
    ``move_started``), taken in the order its export takes them (fewest tokens generated, then the
    lowest row), bring the work moved closest to half of ``gap``."""
    rows = sorted(zip(progress, remaining(progress, means, origin)), key=lambda x: (x[0][1], x[0][0]))
    count, moved = 0, 0.0
    for (_, generated, _), left in rows:
        if (generated and not move_started) or moved + left / 2 > gap / 2:
            break
        count, moved = count + 1, moved + left
    return count
