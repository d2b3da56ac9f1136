"""A recipe's own Ray instance: started without the idle worker processes Ray prestarts for tasks
(a recipe's workers are actors, which start their own), and one actor still starts and answers."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.hybridflow.trainer.recipe_runs import REPO, recipe_env

pytestmark = pytest.mark.slow

# a fresh process: the test process may hold the session's shared Ray instance (start_ray joins it)
SCRIPT = """
import sys, time
from types import SimpleNamespace
import psutil, ray
from hybridflow.ray_watchdog import head_pids
from recipes.ray_start import start_ray

start_ray(SimpleNamespace(address=None, num_cpus=2), {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        import os
        return os.getpid()

probe = Probe.remote()
actor_pid = ray.get(probe.pid.remote())
time.sleep(float(sys.argv[1]))  # prestarted workers are up within a second or two of the driver's start
# this instance's processes only (another test's Ray may run beside it): its workers are children
# of its raylet, one of the head processes the driver started
names = []
for head in head_pids(ray._private.worker._global_node):
    for p in psutil.Process(head).children(recursive=True):
        cmd = " ".join(p.cmdline())
        if cmd.startswith("ray::") and p.pid != actor_pid:
            names.append(cmd.split()[0])
print("IDLE" if "ray::IDLE" in names else "none idle", sorted(set(names)))
ray.shutdown()
"""


def test_a_local_instance_starts_no_idle_workers_and_runs_actors():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "3"], cwd=REPO, env=recipe_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("none idle"), proc.stdout
