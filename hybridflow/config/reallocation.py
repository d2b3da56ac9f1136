"""``actor_rollout_ref.rollout.reallocation``: RLHFSpec's sample reallocation.
Generation is streamed (hybridflow/controller/stream.py, ``GenerationStream``): every
``slice_s`` of engine steps each generation data-parallel rank reports its unfinished samples'
progress, and when the busiest rank's remaining work (estimated tokens: GenerationStream._work)
exceeds the idlest's by more than ``threshold`` of the busiest's, about half the difference moves
from the busiest to the idlest (prompt + tokens so far; the receiver
recomputes their KV cache), so the ranks finish together rather than waiting for the one that was
dealt the long samples. With ``deal_by_length`` the prompts are dealt by their answers' length at
their last generation, so a rank is seldom dealt the long ones in the first place, and a step with
any prompt so dealt moves nothing (hybridflow/trainer/reallocated_rollout.py
``rebalance_threshold`` says why). Greedy tokens
are those of plain generation; sampled ones draw other noise (one vLLM request per sample:
workers/rollout/vllm_stream.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import GREATER_THAN_0, Range, key

# 0 would move on any difference (every slice), 1 never: the gap never exceeds the busiest's work
FRACTION = Range(lambda v: 0 < v < 1, "in (0, 1)")


@dataclass
class ReallocationConfig:
    enable: bool = key(False, "stream generation and move unfinished samples from the busiest generation rank to "
                              "the idlest while it runs (rollout.name=vllm, hybrid_engine=true, "
                              "stage_fusion.enable=false)")
    # 0.25 and 0.1 s: the best of (threshold, slice_s) in {0.5, 0.25} x {0.05, 0.1, 0.2} tried on the long-tail
    # bench (scripts/bench/reallocation.py, 2-core CPU; runs differ by about 5%): a lower threshold moves as
    # soon as the short answers of the lighter rank end, a longer slice costs the stream fewer calls
    threshold: float = key(0.25, "move when the busiest rank's remaining work (estimated tokens) exceeds the "
                                 "idlest's by more than this fraction of the busiest's; about half the difference "
                                 "moves", FRACTION)
    slice_s: float = key(0.1, "seconds of engine steps a rank runs between reports (and reallocation checks)",
                         GREATER_THAN_0)
    # false: measured on the long-tail bench where the busier rank queues (max_num_seqs=32, greedy, 4 repetitions
    # in one process): 0.716 of plain against 0.829 with started samples moved too, whose later moves restart
    # answers that had run 150+ tokens (their KV recomputed) on counts that drift back and forth; where every
    # sample runs from the first step (max_num_seqs >= a rank's samples) nothing queues, so nothing moves:
    # docs/placement.md, sample reallocation
    move_started: bool = key(False, "also move samples that have generated tokens (the receiver recomputes their "
                                    "KV cache over prompt + prefix); false: move only samples still queued for a "
                                    "place in the busiest rank's engine batch, which cost nothing to move")
    # true: measured on the long-tail bench where the busier rank queues (max_num_seqs=32, greedy, 5 repetitions
    # in one process): 0.706 of plain against 0.733 first come first served at threshold 0.25, 0.693 against
    # 0.742 at 0.1; faster in 8 of the 10 paired runs (docs/benchmarks.md, sample reallocation, 2026-11-30 evening)
    adopted_first: bool = key(True, "a moved sample starts on its new rank before that rank's own samples still "
                                    "waiting for a place in its engine batch (vLLM's scheduling_policy=priority, "
                                    "which the rollout engines are then built with; the same order as first come, "
                                    "first served for everything else). false: it waits behind them")
    deal_by_length: bool = key(True, "deal each step's prompts to the ranks by the length of their answers when they "
                                     "were last generated (an earlier epoch): sorted, alternately, longest first "
                                     "(hybridflow/controller/length_deal.py); prompts not seen yet count as "
                                     "the median; a step with any prompt known moves no sample. false: "
                                     "contiguous shares, as a plain generation call deals them")
