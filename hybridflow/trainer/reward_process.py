"""Scoring a generated batch with the reward function, inline or in a Ray process of its own.

``score_batch`` decodes the responses and calls the reward manager; the trainer calls it inline.
With verl's ``reward_model.launch_reward_fn_async`` the same call runs in :class:`RewardProcess`,
a Ray actor, while the workers compute old log-probs, reference log-probs and values. verl
submits a Ray task per step; an actor that lives for the run differs in that its process (and
the imports and reward-function state in it) is made once, not per step: on a 2-core machine
Ray would otherwise start a fresh worker process, importing torch, whenever the last one was
reaped as idle. Unlike a driver thread, the function runs on its process's main thread, so
scorers that time out with ``signal.alarm`` (math_verify and others do) work as they do inline,
and a CPU-bound scorer does not hold the driver's GIL. With ``custom_reward_function.timeout_s``
(the default) the manager in that actor runs each call in a child process of the actor's own, on
that child's main thread, killed at the limit (hybridflow/rewards/scoring_process.py).

A reward model off the actor's pool (``trainer.placement=separate`` or
``reward_model.enable_resource_pool``) is pending in the same way: :class:`PendingModelScores`
holds its group call's future.
"""
from __future__ import annotations

import os
import time

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.rewards.loader import RewardFunctionError
from hybridflow.trajectory import (TOOL_OUTPUTS, extra_infos_with_tool_outputs, response_token_mask,
                                   scores_on_last_generated)


def score_batch(tokenizer, reward_manager, batch: DataProto) -> tuple:
    """(token_level_scores [B,R], per-sample scores, metrics, the reward function's extra fields
    per sample, the decoded responses) for a batch with ``responses``, ``response_mask`` and the
    dataset's ``data_source``, ``ground_truth`` (and optional ``extra_info``) columns."""
    # a multi-turn trajectory's whole response, tool responses included (hybridflow/trajectory.py)
    responses, mask = batch.batch["responses"], response_token_mask(batch.batch)
    lengths = mask.sum(-1).tolist()
    texts = [tokenizer.decode(r[:n].tolist(), skip_special_tokens=True) for r, n in zip(responses, lengths)]
    nt = batch.non_tensor_batch
    extra_infos = extra_infos_with_tool_outputs(nt.get("extra_info", [None] * len(texts)), nt.get(TOOL_OUTPUTS))
    result = reward_manager(texts, lengths, responses.shape[1], list(nt["data_source"]), list(nt["ground_truth"]),
                            extra_infos)
    token_level_scores = scores_on_last_generated(result.token_level_scores, batch.batch)
    return token_level_scores, result.scores, result.metrics, result.extra, texts


def model_scoring(out: DataProto):
    """The reward model's output as ``score``'s tuple: its score sits on each response's last token."""
    rm = out.batch["rm_scores"]
    scores = rm.sum(-1).tolist()
    return rm, scores, {"critic/rm_score/mean": float(np.mean(scores))}, {}, None


class PendingModelScores:
    """The reward model's scores still being computed on its pool; ``result()`` gives them as the
    reward process's pending result does."""

    def __init__(self, future):
        self.future = future

    def result(self):
        return model_scoring(self.future.get())


class RewardScorer:
    """The Ray actor's body: holds the tokenizer and the reward manager (its error counter too)."""

    def __init__(self, tokenizer, reward_manager):
        self.tokenizer, self.reward_manager = tokenizer, reward_manager

    def score(self, batch: DataProto) -> tuple:
        return score_batch(self.tokenizer, self.reward_manager, batch)

    def where(self) -> tuple:
        """(host, pid, start time): lets the driver find this process's scoring child (see shutdown)."""
        import socket

        import psutil

        return socket.gethostname(), os.getpid(), psutil.Process().create_time()

    def close(self) -> None:
        close = getattr(self.reward_manager, "close", None)
        if close is not None:
            close()


class PendingScores:
    """What :meth:`RewardProcess.submit` returns; ``result()`` waits for the scores."""

    def __init__(self, ref):
        self.ref = ref

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self) -> tuple:
        import ray

        try:
            return ray.get(self.ref)
        except ray.exceptions.RayTaskError as err:
            # a function that raised on every sample: the same one-line stop as inline scoring
            if isinstance(err.cause, RewardFunctionError):
                raise err.cause from None
            raise
        except ray.exceptions.RayActorError as err:
            raise RuntimeError("the reward process (reward_model.launch_reward_fn_async=true) died while scoring, "
                               "e.g. the reward function crashed or exited it; run without the key to see the "
                               f"error inline: {err}") from err


class RewardProcess:
    """The reward function in a Ray actor of its own, for the run's lifetime. It takes no CPU
    slot (``num_cpus=0``): the workers hold every slot, and the scorer mostly runs while they
    wait on each other."""

    def __init__(self, tokenizer, reward_manager):
        import ray

        actor_cls = ray.remote(num_cpus=0, max_restarts=0)(RewardScorer)
        self._actor = actor_cls.remote(tokenizer, reward_manager)
        # asked before any scoring call, so answered as soon as the actor starts, never behind one
        self._where = self._actor.where.remote()

    def submit(self, batch: DataProto) -> PendingScores:
        return PendingScores(self._actor.score.remote(batch))

    def shutdown(self) -> None:
        """Stop the scoring child (custom_reward_function.timeout_s), then the actor. ray.kill alone
        left the child running until its watcher saw its parent gone (up to a second; longer on a
        loaded machine), or for good where the watcher thread never ran (a call stuck in C)."""
        import ray

        try:
            if not _kill_children_here(*ray.get(self._where, timeout=10)):
                # the actor is on another node: it stops its child itself, if it is not busy scoring;
                # if it is, its child follows it within a second of the kill below
                ray.get(self._actor.close.remote(), timeout=5)
        except (ray.exceptions.RayError, TimeoutError):  # dead or busy: the kill below is what is left
            pass
        ray.kill(self._actor)


def _kill_children_here(host: str, pid: int, started: float) -> bool:
    """SIGKILL the processes started by ``pid`` (the reward actor) and wait for them to end; False
    where that process is on another host. The start time guards against a reused pid."""
    import socket

    import psutil

    if host != socket.gethostname():
        return False
    try:
        actor = psutil.Process(pid)
        children = actor.children(recursive=True) if actor.create_time() == started else []
    except psutil.NoSuchProcess:  # the actor is gone, and its child followed it (or will, in a second)
        return True
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    # a zombie counts as ended (the actor reaps it, or init does once ray.kill ends the actor);
    # psutil.wait_procs would wait out its timeout on one, as it is not this process's child
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
