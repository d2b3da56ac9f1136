"""The newest staged weights, where a generation in flight can see them (partial rollout).

Calls to a worker run one at a time, in the order submitted, so a weight sync the controller
queues reaches a rollout worker only after the generation it is running. For partial rollout
(``async_training.partial_rollout``) that generation must see the new weights while it runs: the
controller posts each version here as it is staged, and a rollout worker polls ``version()`` between
engine steps (a small remote call, a few times a second) and takes ``latest()`` when it moved.

A Ray actor rather than a file or shared memory: it works across hosts, and a dead controller
takes it down with it. It holds the newest staged weights' object references only, so the bucket
objects of older versions are freed as soon as no rollout worker still reads them.
"""
from __future__ import annotations

import ray


class _Board:
    def __init__(self):
        self._latest = None

    def post(self, staged) -> None:
        if self._latest is None or staged.version >= self._latest.version:
            self._latest = staged

    def version(self) -> int:
        return -1 if self._latest is None else self._latest.version

    def latest(self):
        return self._latest


def new_weight_board():
    """A board for one run (no CPU reserved: it only holds references)."""
    return ray.remote(num_cpus=0)(_Board).remote()
