"""The reward function in a child process of its own, so that one call can be cut at a time limit.

Why a process: a Python function cannot be stopped safely from outside in a thread, and
``signal.alarm`` in the caller's process fails exactly where reward functions hang. A pathological
regex in ``re`` (answer extraction) runs in C and never returns to the interpreter, where a signal
handler would run; scorers such as math_verify arm ``signal.alarm`` themselves, which would
replace or cancel ours; and the alarm needs the main thread. A child process can always be
killed: on a call past ``timeout_s`` the parent kills it, scores that sample 0, starts a fresh
child and goes on with the next sample. A child that dies (a segfault, ``os._exit``) costs the same
one sample, not the run.

Cost: the batch goes to the child in one message; each result comes back in its own small one, so
the parent knows when each call started. The child is started at the first batch (the Python
start-up and the function's imports, once per run and after each timeout), and ignores Ctrl-C:
the parent decides what a stop means (it kills the child, see ``close``).

This file is also the child's program (``python -m hybridflow.rewards.scoring_process``): it
imports only the standard library and cloudpickle at the top, so the child starts in well under a
second unless the reward function itself imports more.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("hybridflow.rewards.manager")  # the manager's: one logger for scoring


@dataclass
class CallOutcome:
    """One call's end: its result, or the exception it raised, or that it ran past the limit."""
    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class ScoringTimeout(Exception):
    """A reward function call ran past ``custom_reward_function.timeout_s`` and was killed."""


def slow_after(timeout_s: float) -> float:
    """When a call still running earns a warning: 10 s, or half the limit when that is sooner."""
    return min(10.0, timeout_s / 2)


class ScoringProcess:
    """Calls ``fn`` in a child process, each call bounded by ``timeout_s`` seconds.

    Picklable (the reward process ships the manager to a Ray actor): the child is not pickled, a
    copy starts its own at its first batch."""

    def __init__(self, fn: Callable, timeout_s: float):
        self.fn, self.timeout_s = fn, timeout_s
        self._proc: subprocess.Popen | None = None
        self._send = self._recv = None

    def __getstate__(self):
        return {"fn": self.fn, "timeout_s": self.timeout_s}

    def __setstate__(self, state):
        self.__init__(state["fn"], state["timeout_s"])

    # ------------------------------------------------------------------ calls
    def call_each(self, calls: list[dict], describe: Callable[[int], str]) -> list[CallOutcome]:
        """``fn(**kwargs)`` for each of ``calls``, in order; ``describe(i)`` names call i in warnings."""
        outcomes: list[CallOutcome] = []
        try:
            while len(outcomes) < len(calls):
                start = len(outcomes)
                self._start()
                self._post(("each", calls[start:]))
                for i in range(start, len(calls)):
                    outcome = self._wait(describe(i))
                    outcomes.append(outcome)
                    if outcome.timed_out or self._proc is None:  # killed or dead: a fresh child goes on
                        break
        except BaseException:  # a stop (SIGTERM, Ctrl-C) mid-batch: the child's state is unknown
            self.close()
            raise
        return outcomes

    def call_once(self, kwargs: dict, what: str) -> CallOutcome:
        """``fn(**kwargs)`` once (the batch manager's call for a whole batch)."""
        try:
            self._start()
            self._post(("once", kwargs))
            return self._wait(what)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the child (a call may be running: no reason to wait for it)."""
        proc, self._proc = self._proc, None
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._send = self._recv = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the child dies with its pipe
            pass

    # ------------------------------------------------------------------ the parent's side
    def _start(self) -> None:
        if self._proc is not None:
            return
        import cloudpickle  # Ray's: pickles a function from a user's file by value
        from multiprocessing.connection import Connection

        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # the child imports what the parent imports: the same path, whatever put entries on it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "hybridflow.rewards.scoring_process", str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send, self._recv = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
        self._send.send_bytes(cloudpickle.dumps(self.fn))

    def _post(self, message) -> None:
        import cloudpickle

        self._send.send_bytes(cloudpickle.dumps(message))

    def _wait(self, what: str) -> CallOutcome:
        """The next result, or a timeout (the child is killed), or the child's death."""
        started = time.monotonic()
        deadline, warn_at = started + self.timeout_s, started + slow_after(self.timeout_s)
        while not self._recv.poll(max(min(warn_at, deadline) - time.monotonic(), 0)):
            now = time.monotonic()
            if now >= deadline:
                self.close()
                return CallOutcome(timed_out=True)
            if now >= warn_at:  # once per call, while it still runs: a stalled step says why
                logger.warning("reward function slow: %s has been scoring for %.0f s; it is cut at "
                               "custom_reward_function.timeout_s=%g", what, now - started, self.timeout_s)
                warn_at = float("inf")
        try:
            kind, payload = pickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError):  # the child died in the call (a crash, os._exit)
            code = self._proc.wait() if self._proc is not None else None
            self.close()
            return CallOutcome(error=RuntimeError(f"the reward function's process died (exit code {code})"))
        except Exception as exc:  # noqa: BLE001 - a result this process cannot rebuild is that call's error
            return CallOutcome(error=exc)
        return CallOutcome(result=payload) if kind == "ok" else CallOutcome(error=payload)


# ---------------------------------------------------------------------- the child's side
def _picklable_error(exc: BaseException) -> BaseException:
    """The exception as the parent can unpickle it, with the child's traceback as a note (a
    traceback does not cross processes; the parent logs the note with the error)."""
    import cloudpickle

    text = "".join(traceback.format_exception(exc)).rstrip()
    try:
        exc.add_note(f"in the reward function's process:\n{text}")
        pickle.loads(cloudpickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type the parent cannot rebuild
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{text}")


def _call(fn, kwargs) -> tuple[str, Any]:
    try:
        return "ok", fn(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward function is that sample's error
        return "error", _picklable_error(exc)


def _exit_with_parent() -> None:
    """The child ends when its parent does (kill -9 included), even inside a call that would never
    read the closed pipe: a thread checks the parent once a second. (Linux's PR_SET_PDEATHSIG
    follows the parent *thread*, which may end long before the process does.)"""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _child_main(read_fd: int, write_fd: int) -> None:
    import cloudpickle
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent()
    recv, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        fn = pickle.loads(recv.recv_bytes())
        while True:
            kind, payload = pickle.loads(recv.recv_bytes())
            for kwargs in (payload if kind == "each" else [payload]):
                reply = _call(fn, kwargs)
                try:
                    data = cloudpickle.dumps(reply)
                except Exception as exc:  # noqa: BLE001 - a result the parent could not unpickle
                    data = cloudpickle.dumps(("error", TypeError(f"reward function returned an unpicklable "
                                                                 f"{type(reply[1]).__name__}: {exc}")))
                send.send_bytes(data)
    except EOFError:  # the parent closed the pipe: the run is over
        pass


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
