"""A process's start time, which tells a live owner from a pid the kernel has since reused.

Used where hybridflow records "this process" to act on it later from elsewhere: the owner tag of
a shared-memory segment (shm_names.py) and the Ray head processes a watchdog may kill
(ray_watchdog.py). Standard library only: the watchdog imports it at its own start.
"""
from __future__ import annotations


def start_time(pid: int) -> int | None:
    """Clock ticks since boot when ``pid`` started (/proc/<pid>/stat field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])  # the command may hold spaces and parentheses
    except (OSError, ValueError, IndexError):
        return None
