"""A run killed with SIGKILL while it holds a named shared-memory segment leaves it in /dev/shm;
the next run's start removes it, and keeps what live processes own (hybridflow/shm_names.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from hybridflow import shm_names
from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not os.path.isdir(shm_names.SHM_DIR), reason="no /dev/shm on this machine")

# what a rank holds between creating its segment and unlinking it once every peer mapped it
_HOLDER = """
import os, sys, time, uuid
from hybridflow import shm_names
path = os.path.join(shm_names.SHM_DIR, f"hybridflow-reshard-{shm_names.owner_tag()}-{uuid.uuid4().hex}-0-1")
with open(path, "wb") as f:
    f.write(bytes(4096))
print(path, flush=True)
time.sleep(600)
"""


def _next_start(rank, world):
    """A resharding buffer's start: rank 0 names the group's segments (sweeping dead runs' first)."""
    from resharding.host_exchange import _group_token

    return _group_token(None)


def test_a_killed_runs_segment_is_removed_by_the_next_start():
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        stale = holder.stdout.readline().strip()
        assert os.path.exists(stale) and shm_names.owner_alive(stale) is True
        assert stale not in shm_names.sweep_stale()  # its owner still runs: kept
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(stale)  # a kill -9 runs no clean-up of its own
    live = os.path.join(shm_names.SHM_DIR, f"hybridflow-reshard-{shm_names.owner_tag()}-{uuid.uuid4().hex}-0-1")
    foreign = os.path.join(shm_names.SHM_DIR, f"hybridflow-reshard-{uuid.uuid4().hex}")  # no owner tag
    for path in (live, foreign):
        open(path, "wb").close()
    try:
        [token] = run_distributed(_next_start, 1)
        assert not os.path.exists(stale)
        assert os.path.exists(live) and os.path.exists(foreign)  # a live owner's, and a name not ours
        assert shm_names.owner_tag(os.getpid()) != token.split("-")[0]  # the new names carry rank 0's owner
    finally:
        for path in (live, foreign):
            os.unlink(path)


def test_a_reused_pid_does_not_keep_a_dead_runs_segment():
    mine = shm_names.owner_tag()
    assert shm_names.owner_alive(f"hf1e1-{mine}-tp") is True
    pid = mine[1:].split("x")[0]
    assert shm_names.owner_alive(f"hf1e1-o{pid}x1-tp") is False  # same pid, another start time
    assert shm_names.owner_alive("hfshm-0123abcd") is None  # no owner tag: never swept
