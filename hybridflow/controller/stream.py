"""Streams, not only batches: a generation whose finished samples come back as they complete.

``GenerationStream(group, prompts)`` starts a generation on every generation data-parallel rank
of ``group`` (a worker group with the ``stream_*`` methods of ``workers/stream_rollout.py``) and
drives each rank in slices of engine steps; every slice hands back the samples that finished in
it. A user's own dataflow can stream too:

    stream = GenerationStream(actor, generation_request(prompts), n=4)
    for chunk in stream:                  # DataProto chunks, rows tagged with ``row_index``
        scores.append(reward(chunk))      # starts while the long tail still generates
    batch = stream.batch()                # every row, in the order generate_sequences returns

Row ``row_index`` is sample j of prompt i at ``i * n + j``, as ``generate_sequences`` orders
them. ``migrate(keep)`` moves every unfinished sample (prompt + tokens so far; the receiving
engine recomputes their KV cache) onto the ``keep`` ranks with the most of them, so the others
are free for other work (RLHFuse's long-tail migration, arXiv 2409.13221 section 4): the
trainer's fused rollout (hybridflow/trainer/fused_rollout.py) drives one, and waits on the
stream's calls and its own in one ``ray.wait`` through ``in_flight`` / ``take``.

``rebalance=threshold`` turns on sample reallocation (RLHFSpec's): after
each handled slice the stream compares the replicas' remaining work and, when the busiest's
exceeds the idlest's by more than ``threshold`` of the busiest's, moves about half the difference
from the busiest to the idlest (a replica whose generation ended included: its engine opens a new
session), so the ranks finish together instead of waiting for the one that was dealt the long
samples. By default only samples still queued (no token generated: the busiest rank's engine
had no place for them yet) move; ``move_started=True`` moves running ones too.
``GenerationStream._work`` says how work is estimated (remaining_work.py) and what differs from
RLHFSpec.

What differs from a plain group call: prompts are split over the generation data-parallel ranks
without padding (rows are identified by index, so unequal shares need no filler), and each rank
is called alone. The ranks of one generation TP group get the same calls (they step one engine
in lockstep); only the collect rank's rows are kept.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np
import ray
import torch

from hybridflow.controller.length_deal import deal_by_length
from hybridflow.controller.remaining_work import mean_lengths, move_count, remaining
from hybridflow.protocol import DataProto

ROW_INDEX = "row_index"
REALLOCATED = "rollout/reallocated_samples"  # samples moved by reallocation
REALLOCATIONS = "rollout/reallocations"  # moves made
REALLOCATED_TOKENS = "rollout/reallocated_prefix_tokens"  # tokens the moved samples had generated (recomputed)
# a session's counts (workers/rollout/vllm_stream.py), summed over a replica's sessions
SUMMED = ("rollout/stream_exported", "rollout/stream_adopted")
# the fewest and most engine steps a slice may ask for; the count aims at ``slice_s`` of stepping
MIN_STEPS, MAX_STEPS = 1, 256
# slices queued per rank: the next one runs while the controller handles the last one's rows, so a
# rank never waits for the controller between slices (with one, 0.27 s of a 1.9 s generation)
DEPTH = 2


class Replica:
    """One generation data-parallel rank: its worker ranks (a TP group), its collect rank, and the
    calls queued on them (Ray runs one actor's calls in order)."""

    def __init__(self, dp_rank: int, ranks: list[int], collect: int):
        self.dp_rank, self.ranks, self.collect = dp_rank, ranks, collect
        self.calls: deque[tuple[str, list]] = deque()  # (method, one ref per rank), oldest first
        self.open = False  # a generation session is running on its engine
        self.unfinished = 0
        self.unstarted = 0  # of them, those with no token generated yet (as of the last slice)
        # (row_index, tokens generated, max_tokens) of each unfinished sample, as of the last slice;
        # None: not reported (no slice yet, or a worker that does not report it)
        self.progress: list[tuple[int, int, int]] | None = None
        self.step_s = None  # the last slice's seconds per engine step
        self.closed_at: float | None = None  # the controller's clock when its generation ended
        self.metrics: dict = {}
        self.retired = False  # migrate() freed its ranks: reallocation moves nothing onto it
        self.export_to: deque[Replica] = deque()  # where each reallocation export queued here goes
        self.settled = True  # a slice's count came back since the last reallocation touched it

    def queued(self, method: str) -> int:
        return sum(m == method for m, _ in self.calls)

    def slices_ahead(self) -> int:
        """Slices queued after the last adopt (those before it cannot step what it brings)."""
        count = 0
        for method, _ in reversed(self.calls):
            if method == "stream_adopt":
                break
            count += method == "stream_step"
        return count


class GenerationStream:
    """``prompts``' generation on ``group``'s rollout ranks, as chunks of finished samples."""

    def __init__(self, group, prompts: DataProto, n: int | None = None, slice_s: float = 0.05,
                 rebalance: float | None = None, lengths=None, move_started: bool = False,
                 adopted_first: bool = False):
        """``n`` samples per prompt: the argument, else ``prompts.meta_info["n"]`` (one of them is
        needed: the row indices depend on it, and the workers' default is their config's).
        ``rebalance``: sample reallocation's threshold in (0, 1) (module docstring), None: off.
        ``lengths``: each prompt's expected answer length (NaN: not known), e.g. its answers' at an
        earlier epoch; the prompts are then dealt by it (``deal_by_length``) instead of in the
        contiguous shares a group call makes. ``move_started``: reallocation may also move
        samples that have generated tokens (the receiver recomputes their prefix); False: only
        samples still queued for a place in the engine's batch. ``adopted_first``: a move's samples
        start on the receiver before its own waiting ones (its engines need vLLM's priority policy)."""
        if n is None and "n" not in prompts.meta_info:
            raise ValueError("GenerationStream: say how many samples per prompt, as n=... or meta_info['n']")
        n = int(prompts.meta_info["n"] if n is None else n)
        if lengths is not None and len(lengths) != len(prompts):
            raise ValueError(f"GenerationStream: {len(lengths)} lengths for {len(prompts)} prompts (one per prompt)")
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
        if rebalance is not None and not 0 < rebalance < 1:  # 1 and above: the gap never exceeds it
            raise ValueError(f"GenerationStream: rebalance={rebalance} must be a fraction in (0, 1), or None")
        self.rebalance, self.move_started, self.adopted_first = rebalance, move_started, adopted_first
        self.reallocated = self.reallocations = 0  # samples moved by reallocation, and the moves
        self.reallocated_tokens = 0  # the tokens those samples had generated: the receivers recompute their KV
        self._moving = False  # a reallocation's export or adopt is queued and not handled yet
        self._answered: set = set()  # refs of queued calls seen answered (in_flight leaves them out)
        prompts = prompts[0:len(prompts)]  # a view: the caller's batch gets no new column
        prompts.meta_info["n"] = n
        prompts.batch[ROW_INDEX] = torch.arange(len(prompts), dtype=torch.long) * n
        starts, start_ranks = [], []
        shares = None if lengths is None else deal_by_length(lengths, len(self.replicas))
        if shares is None:  # contiguous, sizes differing by at most one: the split the mesh dispatch makes
            bounds = np.linspace(0, len(prompts), len(self.replicas) + 1).round().astype(int)
            shares = [list(range(lo, hi)) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        self.dealt = shares  # prompt indices per replica
        # each row's dealt replica, and per dealt replica its finished samples' tokens and count: the
        # remaining-work estimate (_work) judges a sample by the answers of the prompts dealt with it
        self._origin = {p * n + j: k for k, share in enumerate(shares) for p in share for j in range(n)}
        self._finished_tokens, self._finished_count = [0] * len(shares), [0] * len(shares)
        for replica, share in zip(self.replicas, shares):
            replica.open, replica.unfinished = len(share) > 0, len(share) * n
            if not replica.open:  # fewer prompts than replicas: it holds no rank
                replica.closed_at = self.started
                continue
            starts += [self._remote(r, "stream_start", prompts[share]) for r in replica.ranks]
            start_ranks += replica.ranks
        group._wait(starts, "stream_start", ranks=start_ranks)
        for replica in self.replicas:
            self._top_up(replica)

    # ------------------------------------------------------------------ calls
    def _remote(self, rank: int, method: str, *args):
        actor = self.group.actors[rank]
        return getattr(actor, self.group._prefix + method).remote(*args)

    def _queue(self, replica: Replica, method: str, *args) -> None:
        replica.calls.append((method, [self._remote(r, method, *args) for r in replica.ranks]))

    def _top_up(self, replica: Replica) -> None:
        """Keep ``DEPTH`` slices queued on an open replica. The first slice is one engine step:
        it measures the step time the next ones are sized by."""
        while replica.open and replica.slices_ahead() < DEPTH:
            steps = (1 if not replica.step_s else
                     int(min(MAX_STEPS, max(MIN_STEPS, self.slice_s / replica.step_s))))
            self._queue(replica, "stream_step", steps)

    # ------------------------------------------------------------------ driving
    @property
    def in_flight(self) -> list:
        """The Ray refs of the calls queued now that have not answered (wait on them with your
        own). An answered ref stays queued until its whole call (every rank of a TP group) and the
        calls before it have answered; ``ray.wait`` would return it at once every time, and the
        controller's loop would spin on a core the workers need."""
        return [ref for replica in self.replicas for _, refs in replica.calls for ref in refs
                if ref not in self._answered]

    @property
    def done(self) -> bool:
        return not any(replica.calls or replica.open for replica in self.replicas)

    @property
    def unfinished(self) -> int:
        return sum(replica.unfinished for replica in self.replicas)

    def free_ranks(self) -> list[int]:
        """Worker ranks whose engine generates nothing now (finished, or moved its tail away)."""
        return [r for replica in self.replicas if not replica.open for r in replica.ranks]

    def take(self, ready: list) -> list[DataProto]:
        """Handle every queued call whose ranks all answered, oldest first per replica: keep the
        finished rows, queue the next slices; returns the new chunks."""
        ready = set(ready)
        self._answered |= ready.intersection(ref for replica in self.replicas for _, refs in replica.calls
                                             for ref in refs)
        new = []
        for replica in self.replicas:
            while replica.calls and all(ref in ready or _is_ready(ref) for ref in replica.calls[0][1]):
                method, refs = replica.calls.popleft()
                self._answered.difference_update(refs)
                result = self.group._wait(refs, method, ranks=replica.ranks)[replica.ranks.index(replica.collect)]
                new += self._handle(replica, method, result)
            self._top_up(replica)
        if self.rebalance is not None:
            self._reallocate()
        return new

    def _handle(self, replica: Replica, method: str, result) -> list[DataProto]:
        if method == "stream_adopt":  # not counted by the slices queued before it
            replica.unfinished += int(result)
            # a reallocation's last call: the next may be decided (fresh counts, _reallocate)
            self._moving = False
            return []
        if method == "stream_export":  # a reallocation's (migrate waits for its own)
            self._exported(replica, result or [])
            return []
        if method != "stream_step":
            return []
        replica.settled = replica.settled or not self._moving
        if result["steps"]:
            replica.step_s = result["seconds"] / result["steps"]
            replica.unfinished = int(result["unfinished"])
            replica.unstarted = int(result.get("unstarted", 0))
            if result.get("progress") is not None:
                replica.progress = [tuple(p) for p in result["progress"]]
        if result["done"] and result.get("metrics"):
            replica.metrics = _merged_sessions(replica.metrics, result["metrics"])
        # done with an adopt queued behind: the adopt opens a new session on that engine
        if result["done"] and replica.open and not replica.queued("stream_adopt"):
            replica.open, replica.closed_at, replica.unfinished = False, time.perf_counter(), 0
        return self._keep(result["rows"])

    def _keep(self, rows) -> list[DataProto]:
        if rows is None or not len(rows):
            return []
        self.finished_at += [time.perf_counter()] * len(rows)
        self.chunks.append(rows)
        for row, length in zip(rows.batch[ROW_INDEX].tolist(), rows.batch["response_mask"].sum(-1).tolist()):
            origin = self._origin[row]
            self._finished_tokens[origin] += length
            self._finished_count[origin] += 1
        return [rows]

    def wait(self, timeout_s: float | None = None) -> list[DataProto]:
        """Block until some call answers (bounded by the group's call timeout); the new chunks."""
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
        slices the leaving replicas had queued); ``moved`` counts the samples moved."""
        open_ = sorted((r for r in self.replicas if r.open), key=lambda r: -r.unfinished)
        if len(open_) <= keep:
            return []
        keepers, leaving = open_[:keep], open_[keep:]
        new, partials = [], []
        for replica in leaving:  # after its queued slices (one actor runs its calls in order)
            replica.open, replica.retired = False, True
            self._queue(replica, "stream_export")
            self._queue(replica, "stream_metrics")  # its session's, which no slice returns now
            while replica.calls:
                method, refs = replica.calls.popleft()
                result = self.group._wait(refs, method, ranks=replica.ranks)[replica.ranks.index(replica.collect)]
                if method == "stream_export":  # its own, or a reallocation's: the keepers take both
                    partials += result or []
                    if replica.export_to:  # a reallocation's (queued before migrate's own), superseded
                        replica.export_to.popleft()
                        self._moving = False
                elif method == "stream_metrics":
                    replica.metrics = result or replica.metrics
                else:
                    new += self._handle(replica, method, result)
            replica.unfinished, replica.closed_at = 0, time.perf_counter()
        for i, keeper in enumerate(keepers):
            share = partials[i::len(keepers)]
            if share:  # queued behind the keeper's slices; the ones after it go on with them
                self._queue(keeper, "stream_adopt", share)
                self._top_up(keeper)
        self.moved += len(partials)
        return new

    # ------------------------------------------------------------------ sample reallocation
    def _mean_lengths(self) -> list[float]:
        """Per dealt replica, its samples' expected answer length (remaining_work.mean_lengths)."""
        unfinished = (p for r in self.replicas if r.open for p in r.progress or [])
        return mean_lengths(self._finished_tokens, self._finished_count, unfinished, self._origin)

    def _work(self, replica: Replica, means: list[float], counted: bool) -> float:
        """Remaining work: the expected tokens its unfinished samples have still to generate
        (hybridflow/controller/remaining_work.py says how, and why not a count). ``counted``: while
        an open replica has not reported its progress (no slice yet, or a worker that does not
        report it), every replica's work is its count of unfinished samples. What differs from
        RLHFSpec, which moves running requests between generation instances by their load: the
        load is read between slices (a slice late), and a moved sample's KV cache is not sent but
        recomputed by the receiver (prompt + prefix in one prefill, which is why the sender picks
        the shortest prefixes)."""
        if not replica.open:
            return 0.0
        return float(replica.unfinished) if counted else sum(remaining(replica.progress, means, self._origin))

    def _reallocate(self) -> None:
        """Move about half the work difference (``_work``) from the busiest replica to the idlest
        when it exceeds ``rebalance`` of the busiest's. Hysteresis: a move is decided on fresh
        reports only (none in flight, and both replicas have reported a slice since the last move
        touched them) and evens the two out, so the next one needs the difference to grow past the
        threshold again; a report that lags (slices already queued on the busiest still run
        before its export) makes at most that move's size differ, never the direction."""
        if self._moving:
            return
        candidates = [r for r in self.replicas if not r.retired and (r.settled or not r.open)]
        means = self._mean_lengths()
        counted = any(r.open and r.progress is None for r in candidates)
        work = {id(r): self._work(r, means, counted) for r in candidates}
        busiest = max(candidates, key=lambda r: work[id(r)], default=None)
        idlest = min(candidates, key=lambda r: work[id(r)], default=None)
        if busiest is None or busiest is idlest or not busiest.open:
            return
        gap = work[id(busiest)] - work[id(idlest)]
        if gap <= self.rebalance * work[id(busiest)]:
            return
        if counted:  # half the count difference
            count = int(gap // 2) if self.move_started else min(int(gap // 2), busiest.unstarted)
        else:
            count = move_count(busiest.progress, means, self._origin, gap, self.move_started)
        if count < 1:
            return
        self._moving, busiest.settled, idlest.settled = True, False, False
        busiest.export_to.append(idlest)
        # behind the busiest's queued slices (Ray runs one actor's calls in order); the adopt is
        # queued when the export's partials come back (_exported)
        self._queue(busiest, "stream_export", count, not self.move_started)

    def _exported(self, source: Replica, partials: list) -> None:
        target = source.export_to.popleft()
        source.unfinished = max(0, source.unfinished - len(partials))
        if source.progress is not None:  # the moved rows leave its report (the receiver's next one has them)
            gone = {int(p.row_index) for p in partials}
            source.progress = [p for p in source.progress if p[0] not in gone]
        if not partials:  # the source finished them meanwhile
            self._moving = False
            return
        if target.retired:  # migrate freed the target meanwhile: the samples go back
            target = source
        if not target.open:  # its generation ended: the adopt opens a new session on its engine
            target.open, target.closed_at, target.unfinished = True, None, 0
        self._queue(target, "stream_adopt", partials, self.adopted_first)
        self._top_up(target)
        self.reallocated += len(partials)
        self.reallocated_tokens += sum(len(p.token_ids) for p in partials)
        self.reallocations += 1

    # ------------------------------------------------------------------ the result
    def batch(self) -> DataProto:
        """Every finished row in ``row_index`` order (call once the stream is done)."""
        if not self.done:
            raise RuntimeError("GenerationStream.batch(): samples are still generating; iterate the stream first")
        return in_row_order([(c.batch[ROW_INDEX], c) for c in self.chunks], self.total, "GenerationStream")

    def metrics(self) -> dict[str, float]:
        """The stream's timing, as the controller saw it: ``fusion/gen_tail_share``, the share of
        the generation's wall time after the median sample came back (what
        ``perf/gen_tail_share`` is per rank); ``fusion/tail_rank_share``, the share of the
        rank-seconds held by generation that came after it (a rank is held until its replica's
        generation ends: finished, or its tail moved away); the samples moved."""
        out = {"fusion/migrated_samples": float(self.moved)}
        if self.rebalance is not None:
            out.update({REALLOCATED: float(self.reallocated), REALLOCATIONS: float(self.reallocations),
                        REALLOCATED_TOKENS: float(self.reallocated_tokens)})
        if not self.finished_at:
            return out
        last, median = max(self.finished_at), float(np.median(self.finished_at))
        span = last - self.started
        out["fusion/gen_tail_share"] = (last - median) / span if span > 0 else 0.0
        held = [(len(r.ranks), (r.closed_at or last) - self.started) for r in self.replicas]
        total = sum(ranks * s for ranks, s in held)
        tail = sum(ranks * max(0.0, s - (median - self.started)) for ranks, s in held)
        out["fusion/tail_rank_share"] = tail / total if total > 0 else 0.0
        return out


def replica_metrics(stream: GenerationStream) -> dict[str, float]:
    """The ranks' own session metrics (``perf/gen_tail_share``, ``timing_s/gen_worker``, weight
    sync ...): the mean over replicas, as generate_sequences' per-rank metrics are combined."""
    reported: dict[str, list[float]] = {}
    for replica in stream.replicas:
        for key, value in replica.metrics.items():
            reported.setdefault(key, []).append(float(value))
    return {key: float(np.mean(values)) for key, values in reported.items()}


def _merged_sessions(before: dict, after: dict) -> dict:
    """A replica's metrics over its sessions (reallocation reopens a finished one): the last
    session's, with the counts and seconds of every session added up."""
    out = {**before, **after}
    for key in set(before) & set(after):
        if key.startswith("timing_s/") or key in SUMMED:
            out[key] = before[key] + after[key]
    return out


def in_row_order(parts: list[tuple[torch.Tensor, DataProto]], total: int, what: str) -> DataProto:
    """Chunks (row indices, rows) that came back in any order, as one batch in row order; every
    row of ``total`` exactly once, else a RuntimeError naming ``what``."""
    index = torch.cat([i for i, _ in parts])
    out = DataProto.concat([p for _, p in parts])
    if len(out) != total or len(torch.unique(index)) != total:
        raise RuntimeError(f"{what}: {len(out)} rows came back for {total} samples")
    return out.reorder(torch.argsort(index))


def _is_ready(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
