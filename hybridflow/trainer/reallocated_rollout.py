"""The unfused step's generation: one ``generate_sequences`` call, or, with
``actor_rollout_ref.rollout.reallocation.enable``, a ``GenerationStream`` that moves unfinished
samples from the busiest generation rank to the idlest while it runs (RLHFSpec's sample
reallocation: hybridflow/controller/stream.py). Either way the trainer gets the same batch: rows in
generate_sequences' order with its columns (greedy: the same tokens, log-probs to fp32 rounding),
and ``meta_info["metrics"]`` with the ranks' own metrics (``perf/gen_tail_share``,
``timing_s/gen_worker``, the weight sync's) as their mean, plus, streamed,
``rollout/reallocated_samples`` and ``rollout/reallocations``.

ReMax's greedy baseline (one greedy sample per prompt, short and even) stays a plain call; so does
the fused rollout's stream (trainer/fused_rollout.py), whose tail moves by ``migrate_below``.
"""
from __future__ import annotations

from hybridflow.controller.stream import REALLOCATED, REALLOCATIONS, ROW_INDEX, GenerationStream, replica_metrics
from hybridflow.protocol import DataProto


def generate(actor, gen_in: DataProto, n: int, reallocation) -> DataProto:
    """``gen_in``'s ``n`` samples per prompt on ``actor``'s rollout ranks (``reallocation``: the
    config section ``actor_rollout_ref.rollout.reallocation``)."""
    if not reallocation.enable:
        return actor.generate_sequences(gen_in)
    stream = GenerationStream(actor, gen_in, n=n, slice_s=reallocation.slice_s, rebalance=reallocation.threshold)
    for _ in stream:  # the chunks are kept by the stream; batch() puts them in row order
        pass
    out = stream.batch()
    out.pop([ROW_INDEX])
    moved = stream.metrics()
    out.meta_info["metrics"] = {**replica_metrics(stream), REALLOCATED: moved[REALLOCATED],
                                REALLOCATIONS: moved[REALLOCATIONS]}
    return out
