"""The unfused step's generation: one ``generate_sequences`` call, or, with
``actor_rollout_ref.rollout.reallocation.enable``, a ``GenerationStream`` that moves unfinished
samples from the busiest generation rank to the idlest while it runs (RLHFSpec's sample
reallocation: hybridflow/controller/stream.py). Either way the trainer gets the same batch: rows in
generate_sequences' order with its columns (greedy: the same tokens, log-probs to fp32 rounding),
and ``meta_info["metrics"]`` with the ranks' own metrics (``perf/gen_tail_share``,
``timing_s/gen_worker``, the weight sync's) as their mean, plus, streamed,
``rollout/reallocated_samples``, ``rollout/reallocations`` and
``rollout/reallocated_prefix_tokens``, and with ``deal_by_length``
``rollout/dealt_by_length``, the share of the prompts dealt by a known answer length (when it
is 1, no sample moves: ``rebalance_threshold``).

ReMax's greedy baseline (one greedy sample per prompt, short and even) stays a plain call; so does
the fused rollout's stream (trainer/fused_rollout.py), whose tail moves by ``migrate_below``.
"""
from __future__ import annotations

import hashlib

import numpy as np

from hybridflow.controller.stream import (REALLOCATED, REALLOCATED_TOKENS, REALLOCATIONS, ROW_INDEX, GenerationStream,
                                          replica_metrics)
from hybridflow.protocol import DataProto

KNOWN = "rollout/dealt_by_length"  # the share of the step's prompts whose answer length was known


class AnswerLengths:
    """Each prompt's mean answer length when it was last generated, keyed by a digest of its
    token ids: what the next epoch deals its prompts by. Lost on resume (the first epoch after it
    deals as the first did); it only decides which rank generates what, so greedy tokens are the
    same either way."""

    def __init__(self):
        self._by_prompt: dict[bytes, float] = {}

    @staticmethod
    def _keys(gen_in: DataProto) -> list[bytes]:
        ids, mask = gen_in.batch["input_ids"], gen_in.batch["attention_mask"].bool()
        return [hashlib.blake2b(row[keep].numpy().tobytes(), digest_size=16).digest() for row, keep in zip(ids, mask)]

    def expected(self, gen_in: DataProto) -> list[float]:
        """Per prompt: its last mean answer length, NaN when not generated before."""
        return [self._by_prompt.get(k, float("nan")) for k in self._keys(gen_in)]

    def record(self, gen_in: DataProto, out: DataProto, n: int) -> None:
        """``out``: ``gen_in``'s generation, ``n`` rows per prompt in prompt order."""
        lengths = out.batch["response_mask"].sum(1).view(len(gen_in), n).float().mean(1).tolist()
        self._by_prompt.update(zip(self._keys(gen_in), lengths))


def rebalance_threshold(reallocation, expected: list[float] | None) -> float | None:
    """The stream's ``rebalance``: ``reallocation.threshold``, or None (no moves) when any of the
    step's prompts is dealt by a known answer length (then ``deal_by_length`` deals the whole step:
    the known ones sorted, the others as their median, alternately, so no rank holds a contiguous
    run of them). Why: on such a deal the ranks' remaining work drifts apart by how fast each rank
    steps and when its short answers end more than by the deal, and moves on that drift cost more
    than they mend (docs/benchmarks.md, sample reallocation: every prompt known, 0.747 of plain
    with moves against 0.720 without, 2026-11-30 afternoon; half of them known, 0.759 against
    0.675, faster without in 4 of 4 pairs, 2026-11-30 late night; greedy, in one process). So
    moves are the first epoch's (no length known), where the deal is contiguous."""
    if expected is not None and len(expected) and not np.isnan(np.asarray(expected, dtype=float)).all():
        return None
    return reallocation.threshold


def generate(actor, gen_in: DataProto, n: int, reallocation, lengths: AnswerLengths | None = None) -> DataProto:
    """``gen_in``'s ``n`` samples per prompt on ``actor``'s rollout ranks (``reallocation``: the
    config section ``actor_rollout_ref.rollout.reallocation``; ``lengths``: what the prompts were
    answered with before, which ``deal_by_length`` deals them by and this call adds to)."""
    if not reallocation.enable:
        return actor.generate_sequences(gen_in)
    expected = lengths.expected(gen_in) if lengths is not None and reallocation.deal_by_length else None
    stream = GenerationStream(actor, gen_in, n=n, slice_s=reallocation.slice_s,
                              rebalance=rebalance_threshold(reallocation, expected), lengths=expected,
                              move_started=reallocation.move_started, adopted_first=reallocation.adopted_first)
    for _ in stream:  # the chunks are kept by the stream; batch() puts them in row order
        pass
    out = stream.batch()
    out.pop([ROW_INDEX])
    moved = stream.metrics()
    # a step dealt by known lengths moves none (rebalance_threshold): 0, not absent
    out.meta_info["metrics"] = {**replica_metrics(stream), **{key: moved.get(key, 0.0) for key in
                                                              (REALLOCATED, REALLOCATIONS, REALLOCATED_TOKENS)}}
    if expected is not None:
        out.meta_info["metrics"][KNOWN] = float(np.mean(~np.isnan(expected))) if expected else 0.0
        lengths.record(gen_in, out, n)
    return out
