"""Partial rollout (issue 33): a vLLM generate call that takes new weights between engine steps.

``VLLMRollout.generate_sequences(prompts, switch=..., version=...)`` polls ``switch`` between
engine steps; when it returns ``(new_version, weights)``, every sample still generating goes on
with the new weights from the tokens it has, and each response token records the version that
sampled it (``rollout_token_versions``).

How a sample goes on, and why this way: the installed vLLM (0.32) can preempt every running
request and drop the prefix cache in one call, ``reset_prefix_cache(reset_running_requests=True)``.
A preempted request keeps its identity, its generated tokens (scheduler side) and their log-probs
(the output processor's per-request state); when rescheduled, the engine recomputes the KV cache
of prompt + generated tokens, now with the new weights, and samples on with the request's
remaining ``max_tokens``. That is the abort-and-re-enqueue of "prompt + prefix, max_tokens = what
is left", done by the engine: the n child requests of a prompt (vllm_stepping.py) stay what they
are, so nothing has to read an unfinished child's tokens at abort time, rows keep their order,
and requests need no renumbering. Costs: per step a Python call and a clock read (with TP > 1
also the broadcast below), so a call where no switch fires takes what today's takes; per switch,
the weight load plus one recompute prefill of every unfinished sample (demo size, 32 prompts x 8
samples x 8 tokens, tiny model, 1 CPU rank: +31 ms on an 80 ms call, of which the load is 3 ms). Aborting and re-enqueueing prompt + prefix as
n=1 requests would read the same state and pay the same prefill, plus a re-render of each request.

Which version wrote a token comes from vLLM too: the engine labels each step's outputs with its
``set_weight_version`` label and the output processor keeps, per request, the spans of output
tokens per label (``CompletionOutput.weight_versions``). The label is set to ``version`` at the
start of the call and to ``new_version`` at a switch, between steps, so a span is exactly the
tokens sampled with those weights (synchronous scheduling; with vLLM's async scheduling the
preemption drops the tokens still in flight, which are then sampled again with the new weights).

Tensor parallelism: the ranks of one generation TP group step one engine in lockstep
(external_launcher), so they must switch before the same step. The group's first rank polls and
broadcasts the new version, or -1, before the steps it schedules: each message also says how many
steps until the next one, about ``poll_s`` at the step time it measured (1 step at the call's
start and with ``poll_s=0``), so the ranks agree on when to exchange without a clock. The other
ranks call their own ``switch`` only for a version their first rank switched to, and load its
weights (each rank loads full HF-named tensors, vLLM keeps its shard). The broadcast goes through the engine's own TP group, which
external_launcher built once on the worker's torch.distributed world: its shared-memory message
queue (vLLM's ``mq_broadcaster``) when it has one, else torch.distributed over its gloo group.
Why not a gloo group of our own: in a TP=2 engine's two processes on 2 cores (AVX-512 CPU), a
gloo broadcast of one int took 340 us (the message queue: 7 us), and a gloo broadcast before each
of the demo-size call's 9 steps made it 80 -> 96 ms; the message queue before every step still
cost about 1 ms per call, hence the exchanges spaced by ``poll_s``.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

import torch

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# polled between engine steps: None, or (new weight version, the new weights' HF-named tensors)
Switch = Callable[[], "tuple[int, Weights] | None"]

POLL_S = 0.05  # the first TP rank asks ``switch`` at most this often
NONE = -1  # broadcast when there is nothing to switch to; also the version of a pad position
# how long a non-first TP rank waits for its ``switch`` to yield the version its first rank chose
FOLLOW_TIMEOUT_S = 300.0
# how long a TP rank waits for its first rank's decision, or for room to post one: the other rank
# is one engine step away at most, so only a dead or stuck peer takes this long
DECISION_TIMEOUT_S = 300.0
PARTIAL_SAMPLES = "rollout/partial_samples"  # samples whose tokens came from more than one version
WEIGHT_SWITCHES = "rollout/weight_switches"
TOKEN_VERSIONS = "rollout_token_versions"


class WeightSwitcher:
    """The hook ``generate_per_sample`` calls before each engine step: switches the rollout's engine
    to new weights when ``switch`` offers them (decided on the TP group's first rank)."""

    def __init__(self, rollout, switch: Switch, version: int, poll_s: float = POLL_S):
        from vllm.distributed import parallel_state

        self.rollout, self.switch, self.poll_s = rollout, switch, poll_s
        self.version = int(version)
        self.switches = 0
        tp = parallel_state.get_tp_group()  # the engine's TP group: this rank's generation TP group
        self.tp = tp if tp.world_size > 1 else None
        self.polls = self.tp is None or tp.rank_in_group == 0
        self._last_poll = float("-inf")
        # TP > 1: steps until the group's next exchange, and the gap the last one announced
        self._steps_to_exchange, self._gap = 0, 1
        # the labels vLLM puts on this call's tokens until a switch
        rollout.llm.llm_engine.set_weight_version(str(self.version))

    def __call__(self) -> None:
        if self.tp is None:
            offer = self._poll()
        elif self._steps_to_exchange:
            self._steps_to_exchange -= 1
            return
        else:
            offer = self.switch() if self.polls else None
            message = (int(offer[0]) if offer is not None else NONE, self._next_gap() if self.polls else 0)
            decided, self._gap = self._share(message)
            self._steps_to_exchange = self._gap - 1
            if not self.polls and decided != NONE:
                offer = self._follow(decided)
        if offer is not None:
            self._load(*offer)

    def _next_gap(self) -> int:
        """(First TP rank) steps until the next exchange: about ``poll_s`` at the step time since
        the last one; 1 at the call's first exchange, before any step was timed."""
        now = time.monotonic()
        step_s = (now - self._last_poll) / self._gap
        self._last_poll = now
        return max(1, int(self.poll_s / step_s)) if step_s > 0 else 1

    def _share(self, message: tuple[int, int]) -> tuple[int, int]:
        """The first TP rank's (decision, steps to the next exchange), on every rank of the group."""
        queue = self.tp.mq_broadcaster
        if queue is None:  # no shared-memory ring: torch.distributed over the group's gloo group
            return self.tp.broadcast_object(message, src=0)
        if self.polls:
            queue.enqueue(message, timeout=DECISION_TIMEOUT_S)
            return message
        return queue.dequeue(timeout=DECISION_TIMEOUT_S)

    def _poll(self):
        now = time.monotonic()
        if now - self._last_poll < self.poll_s:
            return None
        self._last_poll = now
        return self.switch()

    def _follow(self, version: int):
        """This (non-first) TP rank's weights of the version its first rank switched to."""
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while True:
            offer = self.switch()
            if offer is not None:
                if int(offer[0]) != version:
                    raise RuntimeError(f"partial rollout: this rank's switch offers weight version {offer[0]}, "
                                       f"but its TP group's first rank switched to {version}")
                return offer
            if time.monotonic() > deadline:
                raise RuntimeError(f"partial rollout: this rank's switch gave no weights of version {version} "
                                   f"within {FOLLOW_TIMEOUT_S:g}s of its TP group's first rank switching")
            time.sleep(min(self.poll_s, 0.01) or 0.001)

    def _load(self, version: int, weights: Weights) -> None:
        llm = self.rollout.llm
        # preempt every running sample (its tokens and log-probs stay with its request) and drop
        # the KV blocks computed with the old weights; rescheduled, each recomputes them
        if not llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("partial rollout: vLLM could not drop its KV cache at a weight switch")
        self.rollout.update_weights(weights())
        llm.llm_engine.set_weight_version(str(version))
        self.version = int(version)
        self.switches += 1


def sample_versions(completion, num_tokens: int) -> list[int]:
    """The weight version of each of the first ``num_tokens`` tokens of a finished vLLM sample."""
    spans = completion.weight_versions
    if not spans and num_tokens:
        raise RuntimeError("vLLM reported no weight version for a sample's tokens "
                           "(CompletionOutput.weight_versions): workers/rollout/vllm_partial.py needs it")
    versions = []
    for span in spans or ():
        versions += [int(span.version)] * (span.end - span.start)
    return versions[:num_tokens]


def token_versions(completions: Sequence[Sequence], lengths: torch.Tensor, response_length: int) -> torch.Tensor:
    """[rows, response_length] int tensor: the version of each kept response token, -1 at padding.
    ``completions`` per prompt, its samples in row order; ``lengths`` each row's kept tokens."""
    rows = [comp for per_prompt in completions for comp in per_prompt]
    # one tensor from nested lists: a tensor per row cost 1.3 ms at the demo size (256 rows)
    return torch.tensor([sample_versions(comp, k) + [NONE] * (response_length - k)
                         for comp, k in zip(rows, lengths.tolist())], dtype=torch.long).reshape(len(rows), response_length)


def switch_metrics(versions: torch.Tensor, switcher: WeightSwitcher) -> dict:
    """``rollout/partial_samples``: rows whose tokens span more than one version;
    ``rollout/weight_switches``: switches during the call."""
    lowest = torch.where(versions != NONE, versions, versions.max()).min(1).values
    partial = int((versions.max(1).values > lowest).sum())
    return {PARTIAL_SAMPLES: float(partial), WEIGHT_SWITCHES: float(switcher.switches)}
