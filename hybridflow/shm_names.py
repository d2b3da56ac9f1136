"""Names of hybridflow's shared-memory segments, and the sweep that removes those of dead runs.

Every segment hybridflow (or vLLM, under a name given here) creates in /dev/shm carries its
owner: the pid and start time of the process that named it (rank 0 of its group), as
``...-o<pid>x<start>-...``. Its creators unlink the name as soon as every rank has mapped it, so a
finished, failed or SIGTERMed run leaves nothing; only a process killed inside that window (a
kill -9, the OOM killer) can leave a name behind. The next run that creates a segment first
removes every one of ours whose owner is gone: the pid is not running, or runs a later process
(pid reuse: another start time).

Only this user's files with one of :data:`PREFIXES` and an owner tag are touched; a name of a
live process is kept. Ranks in other pid namespaces sharing /dev/shm would look dead: hybridflow's
workers share the driver's host namespace (Ray, Slurm), which is what this relies on.
"""
from __future__ import annotations

import os
import re

from hybridflow.process_start import start_time

SHM_DIR = "/dev/shm"
# hfshm: shm_group.py; hf<port>e<n>: vLLM's CPU TP communicator (workers/rollout/vllm_rollout.py);
# hybridflow-params / hybridflow-reshard: resharding/shared_params.py and host_exchange.py
PREFIXES = ("hfshm-", "hf", "hybridflow-params-", "hybridflow-reshard-")
_OWNER = re.compile(r"-o(\d+)x(\d+)-")


def owner_tag(pid: int | None = None) -> str:
    """``o<pid>x<start time>`` of this process (or ``pid``): a dead owner is told from a pid reused."""
    pid = os.getpid() if pid is None else pid
    return f"o{pid}x{start_time(pid) or 0}"


def owner_alive(name: str) -> bool | None:
    """Whether the owner in ``name`` still runs; None for a name without an owner tag."""
    found = _OWNER.search(name)
    if not found:
        return None
    pid, start = int(found.group(1)), int(found.group(2))
    return start_time(pid) == start


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments of ours whose owner is gone; returns the names removed."""
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no /dev/shm: nothing to sweep
        return []
    removed = []
    for name in names:
        if not name.startswith(PREFIXES) or owner_alive(name) is not False:
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:  # another rank swept it first, or not ours to remove
            pass
    return removed
