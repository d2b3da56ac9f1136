"""The rollout on a pool of its own (``actor_rollout_ref.hybrid_engine=false``): generation runs
ahead of training by a bounded number of batches, and new weights reach it as versioned buckets.

The paper's **Separation** placement: the trainer pool trains step k while the rollout pool
already samples the prompts of the steps after it with the weights it has. How far ahead is
verl's ``async_training.staleness_threshold`` (τ) with ``trigger_parameter_sync_step`` (T), in
prompts rather than verl's streamed samples: while step k trains, the rollout, holding the weights
of step v, may be given at most

    (v + T * (1 + τ) - k) * B        prompts beyond step k's batch (B: the loader's batch, data.train_batch_size
                                     or dynamic sampling's data.gen_batch_size)

so τ=0 is strict alternation (the next batch starts after the sync that follows the update), τ=1 is
verl's one-step-off policy (batch k+1 samples with step k-1's weights while step k trains), and
τ=0.5 lets half of the next batch start early. A sample trained at step k was generated with
weights at most ⌈τ⌉ + T - 1 steps old; each row carries ``rollout_weight_version``. A batch the
trainer needs now is always generated (dynamic sampling's extra batches), with the newest weights.

What differs from verl's fully-async trainer: the trainer still trains whole batches one step after
another (this keeps every estimator, dynamic sampling, checkpoints and the metrics of the
synchronous loop), and prefetching is submitted when a batch is taken, so nothing is in flight at
a checkpoint where τ=0. After a resume, batches that were in flight are generated again, with the
checkpoint's weights and the rollout's saved random state: deterministic, and identical to the
uninterrupted run where τ=0.

Weights move as the trainer pool's ``stage_weights`` (full HF tensors packed into buckets in Ray's
object store: shared memory between the processes of one host, Ray's transfer between hosts) and
the rollout pool's ``load_weights``; calls to one Ray actor run in the order submitted, so a sync
queued behind batches already submitted reaches the rollout after them.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hybridflow.data.loader import TENSOR_KEYS
from hybridflow.protocol import DataProto


def generation_request(prompts: DataProto, multi_turn: bool = False, **sampling) -> DataProto:
    """What ``generate_sequences`` is given for ``prompts``: their tensors, ``sampling`` (n, ...)
    in meta_info; ``multi_turn``: their non-tensor columns too (the agent loops render
    ``raw_prompt`` and read ``agent_name``, ``extra_info``, ...). The trainer builds its requests
    here too, on either placement."""
    request = prompts.select(list(TENSOR_KEYS), None if multi_turn else [], [])
    request.meta_info.update(sampling)
    return request


def greedy_request(request: DataProto) -> DataProto:
    """ReMax's baseline request (Li et al. 2023): one greedy response per prompt of ``request``."""
    greedy = request.select()
    greedy.meta_info.update(n=1, do_sample=False)
    return greedy


@dataclass
class _Chunk:
    """Prompts given to the rollout pool in one call: the futures of their generations."""
    samples: object  # a GroupFuture of the n samples per prompt
    greedy: object | None  # ReMax's greedy baseline, or None


@dataclass
class _Pulled:
    """A loader batch read ahead: the loader's state before it, the batch, its first prompt's index
    in the run, how many of its prompts were submitted, and their chunks."""
    state: dict
    batch: dict
    epoch: int
    first: int
    submitted: int = 0
    chunks: list = field(default_factory=list)


class AheadLoader:
    """The train loader, read ahead by the rollout pool. ``next_batch()`` gives the loader's next
    batch, as the loader would, and ``generations()`` the rollout's output for it, generated ahead
    where the staleness bound allowed; ``state_dict()`` is the loader's state before the first batch
    not yet taken (a checkpoint's, so a resume generates that batch again)."""

    def __init__(self, loader, trainer_group, rollout_group, *, batch_size: int, n: int, greedy: bool,
                 staleness: float, sync_every: int, board=None):
        self.loader, self.trainer, self.rollout = loader, trainer_group, rollout_group
        self.batch_size, self.n, self.greedy = batch_size, n, greedy
        self.staleness, self.sync_every, self.board = staleness, sync_every, board
        self.version: int | None = None  # the step whose weights the rollout holds (the last sync queued)
        self._done = 0  # steps the trainer finished
        self._pending_load = None
        self._pulled: deque[_Pulled] = deque()  # read from the loader, not yet taken
        self._next_prompt = 0  # index of the next prompt the loader gives
        self._submitted = 0  # prompts submitted to the rollout pool
        self._taken: _Pulled | None = None
        self.epoch = loader.epoch

    @classmethod
    def from_config(cls, cfg, loader, trainer_group, rollout_group, greedy: bool) -> "AheadLoader":
        """As ``async_training.*`` asks; ``greedy``: ReMax's baseline is generated with each batch."""
        from hybridflow.config.derived import prompts_per_generation_batch

        at = cfg.async_training  # B: what the loader gives at a time (dynamic sampling: gen_batch_size)
        return cls(loader, trainer_group, rollout_group, batch_size=prompts_per_generation_batch(cfg),
                   n=cfg.actor_rollout_ref.rollout.n, greedy=greedy, staleness=at.staleness_threshold,
                   sync_every=at.trigger_parameter_sync_step, board=_partial_rollout_board(at))

    # ------------------------------------------------------------------ weights
    def sync(self, step: int, metrics: dict) -> None:
        """Stage the trainer's weights as version ``step`` and queue their load on the rollout pool."""
        t0 = time.perf_counter()
        staged = next(s for s in self.trainer.stage_weights(step) if s is not None)
        metrics["timing_s/weight_sync"] = metrics.get("timing_s/weight_sync", 0.0) + time.perf_counter() - t0
        metrics["weight_sync/bytes"] = float(staged.total_bytes)
        metrics["weight_sync/version"] = float(step)
        self._done = step
        if self.board is not None:  # partial rollout: a generation in flight switches to it now
            self.board.post.remote(staged)
        self._collect_load(metrics)
        self._pending_load = self.rollout.submit("load_weights", staged)
        self.version = step

    def weights_updated(self, step: int, metrics: dict) -> None:
        """After step ``step``'s update: sync every ``trigger_parameter_sync_step`` steps."""
        self._done = step
        if step % self.sync_every == 0:
            self.sync(step, metrics)

    def _collect_load(self, metrics: dict) -> None:
        if self._pending_load is not None:
            loads, self._pending_load = self._pending_load.get(), None
            metrics["timing_s/weight_sync_load"] = max(m["timing_s/weight_sync_load"] for m in loads)

    # ------------------------------------------------------------------ batches
    def _allowance(self) -> int:
        """The index (in prompts read) up to which the rollout may be given prompts now, while the
        step after the last finished one trains on the batch taken (module docstring)."""
        ahead = (self.version + self.sync_every * (1 + self.staleness) - (self._done + 1)) * self.batch_size
        return self._taken.first + self.batch_size + max(0, math.floor(ahead + 1e-9))

    def _pull(self) -> _Pulled:
        state = self.loader.state_dict()
        entry = _Pulled(state, self.loader.next_batch(), self.loader.epoch, self._next_prompt)
        self._next_prompt += self.batch_size
        self._pulled.append(entry)
        return entry

    def _submit(self, entry: _Pulled, stop: int) -> None:
        """Give the rollout pool ``entry``'s prompts from the first not yet given up to ``stop``."""
        prompts = DataProto.from_single_dict(entry.batch)
        if (entry.submitted, stop) != (0, len(prompts)):
            prompts = prompts[entry.submitted:stop]
        gen_in = generation_request(prompts, n=self.n)
        if self.board is not None:  # partial rollout: switch to weights staged while it generates
            gen_in.meta_info["weight_board"] = self.board
        samples = self.rollout.submit("generate_sequences", gen_in)
        greedy = None
        if self.greedy:  # ReMax: the greedy baseline with the same weights
            greedy = self.rollout.submit("generate_sequences", greedy_request(gen_in))
        entry.chunks.append(_Chunk(samples, greedy))
        self._submitted += stop - entry.submitted
        entry.submitted = stop

    def _fill(self, upto: int) -> None:
        """Submit every prompt before index ``upto`` of the run, reading batches as needed."""
        while self._submitted < upto:
            entry = next((e for e in self._pulled if e.submitted < self.batch_size), None) or self._pull()
            self._submit(entry, min(self.batch_size, upto - entry.first))

    def next_batch(self) -> dict:
        """The loader's next batch; its generation is submitted now if it was not already, and the
        prompts the staleness bound allows are submitted behind it."""
        if self.version is None:
            raise RuntimeError("AheadLoader.next_batch: sync() the rollout pool's first weights first")
        head = self._pulled[0] if self._pulled else self._pull()
        self._fill(head.first + self.batch_size)  # on demand: the trainer needs all of it now
        self._taken = self._pulled.popleft()
        self._fill(self._allowance())
        self.epoch = self._taken.epoch
        return self._taken.batch

    def generations(self, metrics: dict) -> tuple[DataProto, DataProto | None]:
        """The rollout's output for the batch ``next_batch`` gave last: (n samples per prompt, ReMax's
        greedy responses or None), in the batch's row order."""
        self._collect_load(metrics)
        chunks = self._taken.chunks
        outs = [c.samples.get() for c in chunks]
        for out in outs:
            metrics.update(out.meta_info.pop("metrics", {}))
        greedy = None
        if self.greedy:
            greedy = [c.greedy.get() for c in chunks]
            for part in greedy:
                part.meta_info.pop("metrics", None)
            greedy = greedy[0] if len(greedy) == 1 else DataProto.concat(greedy)
        metrics["async/prompts_ahead"] = float(self._submitted - self._taken.first - self.batch_size)
        return (outs[0] if len(outs) == 1 else DataProto.concat(outs)), greedy

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The loader's state before the first batch not yet taken: a resume generates it again."""
        return self._pulled[0].state if self._pulled else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._pulled or self._taken is not None:
            raise RuntimeError("AheadLoader.load_state_dict: batches were already read ahead")
        self.loader.load_state_dict(state)
        self.epoch = self.loader.epoch


def _partial_rollout_board(at):
    """Where a generation in flight sees new weights (controller/weight_board.py), when it may use
    them: partial rollout, with generation running ahead of training (none is in flight at a sync
    where the pools take turns)."""
    if not at.partial_rollout or at.staleness_threshold == 0:
        return None
    from hybridflow.controller.weight_board import new_weight_board

    return new_weight_board()


def staleness_metrics(versions, step: int) -> dict:
    """How old the weights that generated a batch were, in steps, when step ``step`` trains on it."""
    age = (step - 1) - np.asarray(versions, dtype=np.float64)
    return {"async/staleness_mean": float(age.mean()), "async/staleness_max": float(age.max()),
            "async/stale_samples_frac": float((age > 0).mean())}
