"""Stage spans: when each stage of this process ran, for the run's timeline (trainer.timeline).

Every ``@register`` method of a worker records itself here under its own name (dispatch.py), so a
new stage needs no code of its own; a part of a stage worth seeing apart (the weight sync inside
``generate_sequences``) opens a nested ``span``. The driver records its own stages the same way.

Spans of one process never overlap: opening a nested span ends the current piece of its parent,
and closing it starts a new piece, so a track reads as a sequence of disjoint (name, start, end)
and its busy time is a plain sum. One process is one track (colocated roles share their slot's
process, and so its track); Ray runs an actor's calls on one thread, so a single stack suffices.

Clock: ``time.time()``, comparable across the processes of one machine. Across nodes the spans are
as aligned as the nodes' clocks (NTP keeps them within about a millisecond on a healthy cluster):
read cross-node gaps shorter than that as noise.

Off by default, and then a call costs one test of a module global. On, the spans wait in a bounded
deque (``MAX_SPANS``, the oldest dropped) until the trainer takes them, once per step.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

MAX_SPANS = 4096  # far above one step's stages; bounds a worker whose spans are never taken

_spans: deque | None = None  # None: not recording
_open: list[list] = []  # the stack of [name, start of its current piece]


def recording() -> bool:
    return _spans is not None


def enable(on: bool = True) -> None:
    global _spans
    if on and _spans is None:
        _spans = deque(maxlen=MAX_SPANS)
    elif not on:
        _spans = None
        _open.clear()


def take() -> list[tuple[str, float, float]]:
    """The spans recorded since the last call, oldest first: (name, start, end) in time.time()."""
    if _spans is None:
        return []
    out = list(_spans)
    _spans.clear()
    return out


def _emit(name: str, start: float, end: float) -> None:
    if _spans is not None and end > start:
        _spans.append((name, start, end))


def relabel(name: str) -> None:
    """Name the innermost open span ``name`` from here on (from inside a registered method: its
    own span). A stream's many step calls record as the stage they serve (``gen``), not as
    ``stream_step``; a no-op when not recording."""
    if _spans is not None and _open:
        _open[-1][0] = name


@contextmanager
def span(name: str) -> Iterator[None]:
    """Record the ``with`` body as stage ``name`` (a no-op when not recording)."""
    if _spans is None:
        yield
        return
    now = time.time()
    if _open:  # the parent's piece so far; it resumes when this span closes
        _emit(_open[-1][0], _open[-1][1], now)
    _open.append([name, now])
    try:
        yield
    finally:
        end = time.time()
        if _open:
            own, start = _open.pop()
            _emit(own, start, end)
        if _open:
            _open[-1][1] = end
