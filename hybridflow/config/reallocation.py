"""``actor_rollout_ref.rollout.reallocation``: RLHFSpec's sample reallocation: the generation data-parallel ranks' remaining work is compared between engine-step
slices, and when it differs by more than ``threshold`` unfinished samples move from the busiest
rank to the idlest (prompt + tokens so far; the receiver recomputes their KV cache), so every rank
finishes at about the same time (hybridflow/controller/stream.py, ``GenerationStream``).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import GREATER_THAN_0, OPEN_UNIT, key


@dataclass
class ReallocationConfig:
    enable: bool = key(False, "stream generation and move unfinished samples from the busiest generation rank to "
                              "the idlest while it runs (rollout.name=vllm, hybrid_engine=true)")
    threshold: float = key(0.5, "move when (busiest - idlest) remaining work exceeds this fraction of the "
                                "busiest's", OPEN_UNIT)
    slice_s: float = key(0.05, "seconds of engine steps a rank runs between checks", GREATER_THAN_0)
