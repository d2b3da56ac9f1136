"""RLHFuse's inter-stage fusion for one PPO step (``stage_fusion.enable``; Zhong et al. 2024,
arXiv 2409.13221, section 4): generation streamed into reward and inference.

The unfused step generates the whole batch, then scores it, then runs the actor's old
log-probs, the reference's log-probs and the critic's values over it, each a pass over every
rank. On long-tailed answer lengths most samples finish early and the batch waits for a few:
every rank decodes a handful of sequences while the finished ones wait. Here:

1. generation is a ``GenerationStream`` (hybridflow/controller/stream.py): each rank hands back
   its finished samples every ``stage_fusion.slice_s`` of engine steps;
2. each chunk is scored at once on the controller (the reward function), and sent to the stages
   on a pool of their own (placement=separate) at once;
3. once at most ``migrate_below`` of the batch's samples are unfinished, they move onto
   ``migrate_to`` rollout ranks (prompt + tokens so far; the receiver recomputes their KV cache),
   and the ranks they leave switch to their training engines: each takes finished rows and runs
   every stage its process hosts on them (``*_local`` worker methods: no collective, so a rank
   computes alone while others still generate), as do ranks whose own samples are done;
4. when generation ends, the rows left are shared among all ranks, in equal parts of their tokens.

A stage that needs every rank of its group for one forward (sharded FSDP, Megatron TP/PP) is not
fused: the step runs it over the whole batch afterwards, as unfused. The numbers are those of the
unfused step up to float rounding (a row's forward does not depend on the rows beside it, except
through the columns a micro-batch is cut to): tests/hybridflow/trainer/test_fused_rollout.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from hybridflow.controller.stream import ROW_INDEX, GenerationStream, in_row_order, replica_metrics
from hybridflow.data.loader import TENSOR_KEYS
from hybridflow.protocol import DataProto
from hybridflow.trainer.reward_process import score_batch

# while samples still generate, a freed rank takes at most this many min_chunks per call, so the
# rows left when generation ends can still be shared evenly
MAX_CHUNKS_PER_CALL = 4


@dataclass
class Stage:
    """One inference stage: its output columns come from ``group.<local>(rows)`` on a freed rank
    (``venue='local'``) or ``group.submit(<method>, rows)`` on its own pool (``'pool'``)."""
    name: str  # the unfused step's timer name
    group: object
    method: str
    local: str
    venue: str


def fused_rollout_for(trainer) -> "FusedRollout":
    """The stages a chunk of finished samples goes through, for a ``PPOTrainer``'s groups: old
    log-probs (unless on-policy or verl's bypass), the reference's, the critic's values. A reward
    model scores after generation, as unfused; the reward function chunk by chunk."""
    stages = []
    if not (trainer.on_policy or trainer.bypass):
        stages.append(("old_log_prob", trainer.actor, "compute_log_prob", "compute_log_prob_local"))
    if trainer.use_ref:
        stages.append(("ref", trainer.ref, "compute_ref_log_prob", "compute_ref_log_prob_local"))
    if trainer.critic is not None:
        stages.append(("values", trainer.critic, "compute_values", "compute_values_local"))
    return FusedRollout(trainer.cfg, trainer.actor, stages, trainer.tokenizer,
                        None if trainer.rm is not None else trainer.reward_manager)


class FusedRollout:
    """Drives one step's generation, reward and inference as one fused stage."""

    def __init__(self, cfg, actor, stages: list[tuple[str, object, str, str]], tokenizer, reward_manager):
        self.cfg, self.actor, self.tokenizer, self.reward_manager = cfg, actor, tokenizer, reward_manager
        self.sf = cfg.stage_fusion
        self._wanted = stages
        self.stages: list[Stage] | None = None  # decided at the first step (asks the workers)

    def _decide(self) -> list[Stage]:
        """Where each stage runs: on freed ranks when its group is the generation's processes and
        its layout needs no collective, on its own pool when that shares no process with them,
        else not here (the step runs it afterwards)."""
        stages = []
        for name, group, method, local in self._wanted:
            if set(group.pids).isdisjoint(self.actor.pids):
                stages.append(Stage(name, group, method, local, "pool"))
            elif group.pids == self.actor.pids and all(group.execute_all("local_inference_ok")):
                stages.append(Stage(name, group, method, local, "local"))
        return stages

    # ------------------------------------------------------------------ one step
    def run(self, gen_in: DataProto, batch: DataProto, n: int, metrics: dict):
        """Generate ``gen_in`` (``n`` per prompt) and compute what it can meanwhile. Returns (the
        batch of ``n`` rows per prompt of ``batch`` with the rollout's columns, the reward's
        columns and every fused stage's, in generate_sequences' row order; the scoring tuple of
        ``PPOTrainer.score``, or None when not scored here)."""
        if self.stages is None:
            self.stages = self._decide()
        start = time.perf_counter()
        full = batch.repeat(n, interleave=True)
        full.pop(list(TENSOR_KEYS))  # the rollout's rows carry prompt + response
        stream = GenerationStream(self.actor, gen_in, n=n, slice_s=self.sf.slice_s)
        local = [s for s in self.stages if s.venue == "local"]
        work = _LocalWork(self.actor, local, self.sf.min_chunk)
        pool_parts = {s.name: [] for s in self.stages if s.venue == "pool"}
        scored, migrated, migrated_at = [], False, None

        def arrived(chunks: list[DataProto]) -> None:
            for chunk in chunks:
                index = chunk.batch[ROW_INDEX]
                rows = full[index]
                rows.union(chunk)
                if self.reward_manager is not None:  # the reward function, on this process, now
                    scored.append((index, score_batch(self.tokenizer, self.reward_manager, rows)))
                for stage in self.stages:
                    if stage.venue == "pool":
                        pool_parts[stage.name].append((index, stage.group.submit(stage.method, rows)))
                if local:
                    work.queue(rows)

        while not stream.done:
            ready, _ = ray.wait(stream.in_flight + work.in_flight, num_returns=1,
                                timeout=self.actor.timeout_s)
            if not ready:
                raise TimeoutError(f"{self.actor.name}: neither a rollout slice nor an inference call answered "
                                   f"within {self.actor.timeout_s:g}s")
            arrived(stream.take(ready))
            work.take()
            if (not migrated and self.sf.migrate_below > 0 and stream.unfinished
                    and stream.unfinished <= self.sf.migrate_below * stream.total):
                migrated = True  # once: a replica that closed never reopens, so nothing more could move
                arrived(stream.migrate(keep=self.sf.migrate_to))
                migrated_at = time.perf_counter() - start if stream.moved else None
            if not stream.done:  # the last rows go to finish(), shared among every rank, not to the first one free
                work.feed(stream.free_ranks())
        gen_done = time.perf_counter() - start
        work.finish(self.actor.world_size)
        out = stream.batch()
        out.pop([ROW_INDEX])
        columns = [work.result(len(out))] if local else []
        for name, parts in pool_parts.items():
            columns.append(in_row_order([(index, future.get()) for index, future in parts], len(out), f"fused rollout ({name})"))
        for part in columns:
            out.union(part)
        metrics.update(stream.metrics())
        metrics.update({"fusion/gen_s": gen_done, "fusion/inference_after_gen_s": time.perf_counter() - start - gen_done,
                        "fusion/rows_inferred_during_gen": float(work.rows_during_gen)})
        if migrated_at is not None:
            metrics["fusion/migrated_at_s"] = migrated_at
        metrics.update(replica_metrics(stream))  # the ranks' own (perf/gen_tail_share ...): their mean
        scoring = (merge_scorings(scored, len(out), self.reward_manager, full.non_tensor_batch.get("data_source"))
                   if scored else None)
        return out, scoring


class _LocalWork:
    """Finished rows waiting for the stages a freed rank hosts, and the calls running them."""

    def __init__(self, actor, stages: list[Stage], min_chunk: int):
        self.actor, self.stages, self.min_chunk = actor, stages, min_chunk
        self.waiting: list[DataProto] = []
        self.busy: dict[int, list] = {}  # rank -> refs of its calls not answered yet
        self.done: list[tuple[torch.Tensor, list]] = []  # (row indices, refs) of every call made
        self.rows_during_gen = 0

    @property
    def in_flight(self) -> list:
        """Refs not answered yet: ``ray.wait`` returns an answered ref at once, so one left in
        (a rank's first stage done, its next ones running) would make the controller spin."""
        return [ref for refs in self.busy.values() for ref in refs]

    def queue(self, rows: DataProto) -> None:
        self.waiting.append(rows)

    def _waiting_tokens(self) -> torch.Tensor:
        """Each waiting row's real tokens (prompt + response), in queue order: what its forwards cost."""
        return torch.cat([r.batch["attention_mask"].sum(dim=1) for r in self.waiting])

    def _give(self, rank: int, count: int) -> None:
        rows = DataProto.concat(self.waiting)
        given, rest = rows[:count], rows[count:]
        self.waiting = [rest] if len(rest) else []
        refs = []
        for stage in self.stages:
            actor = stage.group.actors[rank]
            refs.append(getattr(actor, stage.group._prefix + stage.local).remote(given))
        self.busy[rank] = refs
        self.done.append((given.batch[ROW_INDEX], refs))

    def feed(self, free_ranks: list[int]) -> None:
        """While samples still generate: give each idle free rank at least ``min_chunk`` rows, at
        most ``min_chunk * MAX_CHUNKS_PER_CALL``, and beyond ``min_chunk`` at most a ``1 / ranks``
        part of the waiting tokens. The answers that run to the length limit finish together, just
        before generation ends; a free rank that took them all would compute them alone while the
        ranks that generated them wait."""
        ranks = self.actor.world_size
        for rank in free_ranks:
            if rank in self.busy or not self.waiting:
                continue
            tokens = self._waiting_tokens()
            if len(tokens) < self.min_chunk:
                return
            share = rows_for_tokens(tokens, float(tokens.sum()) / ranks)
            count = min(len(tokens), self.min_chunk * MAX_CHUNKS_PER_CALL, max(self.min_chunk, share))
            self.rows_during_gen += count
            self._give(rank, count)

    def take(self) -> None:
        """Drop the answered refs from ``busy`` (a worker's error raises here); a rank is idle once
        all its calls answered."""
        for rank, refs in list(self.busy.items()):
            answered, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            if answered:
                self.actor._wait(answered, "local inference", ranks=[rank] * len(answered))
            if pending:
                self.busy[rank] = pending
            else:
                del self.busy[rank]

    def finish(self, ranks: int) -> None:
        """Generation is over: share the rows left among every rank, then wait for all calls.

        A share is a ``1 / ranks`` part of the tokens left, not of the rows: the rows that finish
        last are the long ones (on a long tail, often most of the inference work), so equal row
        counts would leave the rank that took the late rows computing alone."""
        while self.waiting or self.busy:
            idle = [r for r in range(ranks) if r not in self.busy]
            share = float(self._waiting_tokens().sum()) / ranks if self.waiting else 0.0
            for rank in idle:
                if not self.waiting:
                    break
                self._give(rank, rows_for_tokens(self._waiting_tokens(), share))
            if self.busy:
                ready, _ = ray.wait(self.in_flight, num_returns=1, timeout=self.actor.timeout_s)
                if not ready:
                    raise TimeoutError(f"{self.actor.name}: a local inference call did not answer within "
                                       f"{self.actor.timeout_s:g}s")
                self.take()

    def result(self, total: int) -> DataProto:
        """Every stage's columns for all ``total`` rows, in row order."""
        parts = []
        for index, refs in self.done:
            outs = [ray.get(ref) for ref in refs]
            merged = outs[0]
            for other in outs[1:]:
                merged.union(other)
            parts.append((index, merged))
        return in_row_order(parts, total, "fused rollout (local inference)")


def rows_for_tokens(tokens: torch.Tensor, share: float) -> int:
    """How many leading rows (``tokens``: each row's token count, in queue order) come closest to
    ``share`` tokens; at least one."""
    total = torch.cumsum(tokens.double(), 0)
    return int(torch.argmin((total - share).abs())) + 1


def merge_scorings(scored: list[tuple[torch.Tensor, tuple]], total: int, reward_manager, sources=None) -> tuple:
    """One scoring tuple (``PPOTrainer.score``'s) for the whole batch from the chunks', in row
    order; the batch's reward metrics are recomputed over every row, as one call would give them."""
    index = torch.cat([i for i, _ in scored])
    order = torch.argsort(index).tolist()
    if len(order) != total:
        raise RuntimeError(f"fused rollout: {len(order)} scored rows for {total} samples")
    token_scores = torch.cat([s[0] for _, s in scored])[order]
    scores = [x for _, s in scored for x in s[1]]
    scores = [scores[i] for i in order]
    keys = sorted({k for _, s in scored for k in s[3]})
    extra = {}
    for k in keys:
        column = [v for _, s in scored for v in s[3].get(k, [None] * len(s[1]))]
        extra[k] = [column[i] for i in order]
    texts = None
    if all(s[4] is not None for _, s in scored):
        flat = [t for _, s in scored for t in s[4]]
        texts = [flat[i] for i in order]
    metrics = _merged_reward_metrics(scored, scores, extra, sources, reward_manager)
    return token_scores, scores, metrics, extra, texts


def _merged_reward_metrics(scored, scores, extra, sources, reward_manager) -> dict[str, float]:
    """The reward manager's batch metrics over every row (its ``_metrics``, as one call over the
    batch computes them), else the chunks' metrics weighted by their rows; counts summed."""
    counts = ("reward/errors", "reward/timeouts")
    sums = {k: sum(float(s[2].get(k, 0.0)) for _, s in scored) for k in counts if any(k in s[2] for _, s in scored)}
    compute = getattr(reward_manager, "_metrics", None)
    if compute is not None and sources is not None:
        metrics = compute(scores, list(sources), extra, int(sums.get("reward/errors", 0)))
        if "overlong_reward" in extra:  # the manager's overlong buffer
            metrics["reward/overlong_penalty/mean"] = float(np.mean(extra["overlong_reward"]))
            metrics["reward/overlong/frac"] = float(np.mean([bool(v) for v in extra["overlong"]]))
        return {**metrics, **sums}
    rows = sum(len(s[1]) for _, s in scored)
    weighted: dict[str, float] = {}
    for _, s in scored:
        for k, v in s[2].items():
            if k not in counts:
                weighted[k] = weighted.get(k, 0.0) + float(v) * len(s[1]) / rows
    return {**weighted, **sums}
