"""Streams, not only batches: a generation whose finished samples come back as they complete.

``GenerationStream(group, prompts)`` starts a generation on every generation data-parallel rank
of ``group`` (a worker group with the ``stream_*`` methods of ``workers/stream_rollout.py``) and
drives each rank in slices of engine steps; every slice hands back the samples that finished in
it. A user's own dataflow can stream too:

    stream = GenerationStream(actor, prompts)
    for chunk in stream:                  # DataProto chunks, rows tagged with ``row_index``
        scores.append(reward(chunk))      # starts while the long tail still generates
    batch = stream.batch()                # every row, in the order generate_sequences returns

Row ``row_index`` is sample j of prompt i at ``i * n + j``, as ``generate_sequences`` orders
them. ``migrate(keep)`` moves every unfinished sample (prompt + tokens so far; the receiving
engine recomputes their KV cache) onto the ``keep`` ranks with the most of them, so the others
are free for other work (RLHFuse's long-tail migration, arXiv 2409.13221 section 4): the
trainer's fused rollout (hybridflow/trainer/fused_rollout.py) drives one, and waits on the
stream's calls and its own in one ``ray.wait`` through ``in_flight`` / ``take``.

What differs from a plain group call: prompts are split over the generation data-parallel ranks
without padding (rows are identified by index, so unequal shares need no filler), and each rank
is called alone. The ranks of one generation TP group get the same calls (they step one engine
in lockstep); only the collect rank's rows are kept.
"""
from __future__ import annotations

import time

import numpy as np
import ray
import torch

from hybridflow.protocol import DataProto

ROW_INDEX = "row_index"
# the fewest and most engine steps a slice may ask for; the count aims at ``slice_s`` of stepping
MIN_STEPS, MAX_STEPS = 1, 256


class Replica:
    """One generation data-parallel rank: its worker ranks (a TP group), its collect rank."""

    def __init__(self, dp_rank: int, ranks: list[int], collect: int):
        self.dp_rank, self.ranks, self.collect = dp_rank, ranks, collect
        self.refs: list = []  # the slice in flight, one ref per rank
        self.adopting: list = []  # stream_adopt calls queued behind it, one ref per rank
        self.open = False  # a generation session is running on its engine
        self.unfinished = 0
        self.step_s = None  # the last slice's seconds per engine step
        self.metrics: dict = {}


class GenerationStream:
    """``prompts``' generation on ``group``'s rollout ranks, as chunks of finished samples."""

    def __init__(self, group, prompts: DataProto, n: int = 1, slice_s: float = 0.05, steps: int = 4):
        self.group, self.n, self.slice_s = group, n, slice_s
        self.total = len(prompts) * n
        info = group.mesh_info("rollout")
        by_dp: dict[int, list[int]] = {}
        for rank, dp in enumerate(info.dp_ranks):
            by_dp.setdefault(dp, []).append(rank)
        self.replicas = [Replica(dp, by_dp[dp], next(r for r in by_dp[dp] if info.collect[r]))
                         for dp in range(info.dp_size)]
        self.chunks: list[DataProto] = []
        self.started = time.perf_counter()
        self.finished_at: list[float] = []  # the controller's clock when each sample came back
        self.moved = 0
        prompts = prompts[0:len(prompts)]  # a view: the caller's batch gets no new column
        prompts.batch[ROW_INDEX] = torch.arange(len(prompts), dtype=torch.long) * n
        starts = []
        # contiguous shares, sizes differing by at most one: the split the mesh dispatch would make
        bounds = np.linspace(0, len(prompts), len(self.replicas) + 1).round().astype(int)
        for replica, lo, hi in zip(self.replicas, bounds[:-1], bounds[1:]):
            share = prompts[int(lo):int(hi)]
            starts += [self._remote(r, "stream_start", share) for r in replica.ranks]
            replica.open, replica.unfinished = hi > lo, int(hi - lo) * n
        group._wait(starts, "stream_start")
        for replica in self.replicas:
            if replica.open:
                self._step(replica, steps)

    # ------------------------------------------------------------------ calls
    def _remote(self, rank: int, method: str, *args):
        actor = self.group.actors[rank]
        return getattr(actor, self.group._prefix + method).remote(*args)

    def _step(self, replica: Replica, steps: int) -> None:
        replica.refs = [self._remote(r, "stream_step", steps) for r in replica.ranks]

    def _next_steps(self, replica: Replica) -> int:
        if not replica.step_s:
            return 4
        return int(min(MAX_STEPS, max(MIN_STEPS, self.slice_s / replica.step_s)))

    # ------------------------------------------------------------------ driving
    @property
    def in_flight(self) -> list:
        """The Ray refs of every slice running now (wait on them with your own)."""
        return [ref for replica in self.replicas for ref in replica.refs + replica.adopting]

    @property
    def done(self) -> bool:
        return not any(replica.refs for replica in self.replicas)

    @property
    def unfinished(self) -> int:
        return sum(replica.unfinished for replica in self.replicas)

    def free_ranks(self) -> list[int]:
        """Worker ranks whose engine generates nothing now (finished, or moved its tail away)."""
        return [r for replica in self.replicas if not replica.open for r in replica.ranks]

    def take(self, ready: list) -> list[DataProto]:
        """Handle the slices among ``ready`` refs whose every call answered: keep their finished
        rows, start each replica's next slice; returns the new chunks."""
        ready = set(ready)
        new = []
        for replica in self.replicas:
            calls = replica.refs + replica.adopting
            if not replica.refs or not all(ref in ready or _is_ready(ref) for ref in calls):
                continue
            size, at = len(replica.ranks), replica.ranks.index(replica.collect)
            adopts = len(replica.adopting) // size
            replica.refs, replica.adopting = [], []
            results = self.group._wait(calls, "stream_step")
            result = results[at]
            if result["steps"]:
                replica.step_s = result["seconds"] / result["steps"]
            new += self._keep(result["rows"])
            # samples adopted after this slice counted are still to run, even if it said done
            adopted = sum(int(results[size * (k + 1) + at]) for k in range(adopts))
            replica.unfinished = int(result["unfinished"]) + adopted
            if result["done"] and not adopted:
                replica.open = False
                replica.metrics = result.get("metrics", {})
            else:
                self._step(replica, self._next_steps(replica))
        return new

    def _keep(self, rows) -> list[DataProto]:
        if rows is None or not len(rows):
            return []
        self.finished_at += [time.perf_counter()] * len(rows)
        self.chunks.append(rows)
        return [rows]

    def wait(self, timeout_s: float | None = None) -> list[DataProto]:
        """Block until some slice answers (bounded by the group's call timeout); its chunks."""
        refs = self.in_flight
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s or self.group.timeout_s)
        if not ready:
            raise TimeoutError(f"{self.group.name}: no rollout rank answered stream_step within "
                               f"{timeout_s or self.group.timeout_s:g}s")
        return self.take(ready)

    def __iter__(self):
        while not self.done:
            yield from self.wait()

    # ------------------------------------------------------------------ the long tail
    def migrate(self, keep: int = 1) -> list[DataProto]:
        """Move every unfinished sample onto the ``keep`` open replicas with the most of them;
        the others close (their ranks are free). Returns the chunks that finished meanwhile (the
        slices the leaving replicas had in flight); ``moved`` counts the samples moved."""
        open_ = sorted((r for r in self.replicas if r.open and r.refs), key=lambda r: -r.unfinished)
        if len(open_) <= keep:
            return []
        keepers, leaving = open_[:keep], open_[keep:]
        new, partials = [], []
        for replica in leaving:  # after the slice in flight (one actor runs its calls in order)
            exports = [self._remote(r, "stream_export") for r in replica.ranks]
            calls, replica.refs = replica.refs + exports, []
            results = self.group._wait(calls, "stream_export")
            at = replica.ranks.index(replica.collect)
            step, exported = results[at], results[len(replica.ranks) + at]
            new += self._keep(step["rows"])
            replica.metrics = step.get("metrics", {})
            partials += exported or []
            replica.open, replica.unfinished = False, 0
        for i, keeper in enumerate(keepers):
            share = partials[i::len(keepers)]
            if share:  # queued behind the keeper's slice in flight; its next slice goes on with them
                keeper.adopting += [self._remote(r, "stream_adopt", share) for r in keeper.ranks]
        self.moved += len(partials)
        return new

    # ------------------------------------------------------------------ the result
    def batch(self) -> DataProto:
        """Every finished row in ``row_index`` order (call once the stream is done)."""
        if not self.done:
            raise RuntimeError("GenerationStream.batch(): samples are still generating; iterate the stream first")
        out = DataProto.concat(self.chunks)
        order = torch.argsort(out.batch[ROW_INDEX])
        out = out.reorder(order)
        if len(out) != self.total:
            raise RuntimeError(f"GenerationStream: {len(out)} rows came back for {self.total} samples")
        return out

    def metrics(self) -> dict[str, float]:
        """The stream's timing, as the controller saw it: the share of the generation after the
        median sample came back, and the samples moved."""
        out = {"fusion/migrated_samples": float(self.moved)}
        if self.finished_at:
            last = max(self.finished_at)
            span = last - self.started
            out["fusion/gen_tail_share"] = (last - float(np.median(self.finished_at))) / span if span > 0 else 0.0
        return out


def _is_ready(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
