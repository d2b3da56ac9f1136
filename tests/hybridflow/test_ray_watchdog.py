"""A driver killed with SIGKILL leaves no process of the Ray instance it started (its dashboard
and runtime-env agents outlived it before), and a cluster it only joined is left alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hybridflow import ray_watchdog

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc (Linux)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a run's start as recipes/main_ppo.py does it, then a worker, then the kill
_DRIVER = """
import os, ray
from hybridflow import ray_watchdog
ray.init(address="local", num_cpus=1, include_dashboard=False)
ray_watchdog.guard_local_ray()
ray.get(ray.remote(lambda: 0).remote())  # a worker process too
print(os.path.realpath(ray._private.worker._global_node.get_session_dir_path()), flush=True)
import time; time.sleep(600)
"""


def _ray_processes(session: str) -> list[int]:
    return ray_watchdog.session_processes(session)


@pytest.mark.slow
def test_nothing_of_a_killed_runs_ray_is_left():
    # started elsewhere than the repository: the watchdog must still find its module
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd="/", stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": ROOT})
    try:
        session = driver.stdout.readline().strip()
        assert session, "the driver did not start Ray"
        assert _ray_processes(session), "no process writes to the session: the test would prove nothing"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 30
    while _ray_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes(session) == []


def test_a_joined_cluster_is_never_guarded(monkeypatch):
    """Connected by address (the user's cluster, a Slurm job's): the driver did not start it."""
    import ray

    class Joined:
        head = False

    monkeypatch.setattr(ray._private.worker, "_global_node", Joined(), raising=False)
    assert ray_watchdog.guard_local_ray() is None


def test_a_reused_pid_is_not_killed():
    """Head processes are recorded with their start time: another process on the same pid is spared."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert ray_watchdog.clean_up("/no/such/session", [(sleeper.pid, 1)]) == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
