"""A run's own Ray instance does not outlive the run, even when the run is killed with SIGKILL.

``ray.init(address="local")`` starts the head processes (GCS, raylet, dashboard, monitors) tied
to the driver: they die with it. The raylet's agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) are not: when the raylet dies they try to report it to the GCS, which
is gone too, and were seen still running minutes after a ``kill -9`` of the driver (Ray 2.60),
holding memory and ports.

:func:`guard_local_ray` starts a small watchdog process (stdlib only, its own session, so a kill
of the run's process group spares it) that waits for the driver to exit and then kills what is
left of this Ray instance: every process of this user that holds a file open in the instance's
session folder (``/tmp/ray/session_<time>_<driver pid>``: each agent and worker writes its logs
there; their environment cannot tell, setproctitle overwrites it) and the head processes it
recorded at start (pid and start time, so a reused pid is never hit). Only for an instance this
run started itself: a cluster joined by address (the user's, or a Slurm job's) is never touched.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from hybridflow.process_start import start_time


def head_pids(node) -> list[int]:
    """The pids of the processes a Ray head node started (GCS, raylet, the dashboard's, ...):
    ``ray._private.worker._global_node`` in the driver that started the instance."""
    return [info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None]


def guard_local_ray() -> subprocess.Popen | None:
    """After ``ray.init(address="local", ...)`` in the driver: start the watchdog of this instance.
    None where there is nothing to guard (no /proc, Ray not started here)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.head or not os.path.isdir("/proc"):
        return None
    heads = [f"{pid}:{start_time(pid)}" for pid in head_pids(node)]
    me = f"{os.getpid()}:{start_time(os.getpid())}"
    session = os.path.realpath(node.get_session_dir_path())
    # importable from wherever the driver was started (a script path, another working directory)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "hybridflow.ray_watchdog", me, session, *heads], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _wait_for_exit(pid: int, start: int) -> None:
    """Block until ``pid`` (started at ``start``) has exited."""
    try:
        fd = os.pidfd_open(pid)  # readable once the process exits: no polling
    except (AttributeError, OSError):
        fd = None
    if fd is not None and start_time(pid) == start:
        select.select([fd], [], [])
        os.close(fd)
        return
    while start_time(pid) == start:
        time.sleep(0.5)


def session_processes(session_dir: str) -> list[int]:
    """This user's processes holding a file open under ``session_dir``."""
    inside, found = session_dir.rstrip("/") + "/", []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(inside):
                    found.append(int(entry))
                    break
            except OSError:
                pass
    return found


def clean_up(session_dir: str, heads: list[tuple[int, int]]) -> list[int]:
    """SIGKILL what is left of the Ray instance of ``session_dir``; returns the pids signalled."""
    targets = [pid for pid, start in heads if start_time(pid) == start] + session_processes(session_dir)
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return targets


def main(argv: list[str]) -> None:
    driver, session_dir, *heads = argv
    pid, start = (int(x) for x in driver.split(":"))
    _wait_for_exit(pid, start)
    # a clean ray.shutdown() has stopped everything already; after a kill -9 give the processes
    # that do notice (workers, fate-shared heads) a moment, then take what is left
    time.sleep(1.0)
    clean_up(session_dir, [(int(p), int(s)) for p, s in (h.split(":") for h in heads) if s != "None"])


if __name__ == "__main__":
    main(sys.argv[1:])
