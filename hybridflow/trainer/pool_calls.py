"""One form for a PPO stage's call on a worker group that may run on a pool of its own.

With placement=separate (and ``trainer.overlap_separate_pools``) a role whose processes are not
the actor's is submitted without waiting and collected when the step needs its result, so both
pools work at once (HybridFlow's point of separate placement); the stage's ``timing_s/*`` then
counts only the wait the overlap did not hide. A role on the actor's own processes cannot run
meanwhile: its call is made in turn, where the step collects it, or at once when asked, so a
colocated run calls its groups in the order and under the timers of plain blocking calls.
"""
from __future__ import annotations

from typing import Any


class InTurn:
    """A call on the actor's own processes, made when ``get()`` asks for its result."""

    def __init__(self, group, method: str, batch):
        self._group, self._method, self._batch = group, method, batch

    def get(self) -> Any:
        return getattr(self._group, self._method)(self._batch)


class Done:
    """A call already made; ``get()`` gives its result."""

    def __init__(self, result):
        self._result = result

    def get(self) -> Any:
        return self._result


def start(group, method: str, batch, overlapped: bool, at_once: bool = False):
    """``group.method(batch)`` as something whose ``get()`` gives the result: submitted now when
    ``overlapped``; else made at ``get()``, or now with ``at_once``."""
    if overlapped:
        return group.submit(method, batch)
    return Done(getattr(group, method)(batch)) if at_once else InTurn(group, method, batch)
