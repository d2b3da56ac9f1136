"""Ray for a recipe run: the cluster named by ``ray_init.address`` (or ``RAY_ADDRESS``), else a
local instance of this run's own.

A local instance differs from a bare ``ray.init()`` in three ways:
- no dashboard UI (``include_dashboard=False``; Ray 2.60 still starts its API server process);
- no worker prestart: Ray starts idle worker processes for tasks when the first driver connects,
  and a recipe runs actors, which start workers of their own. The idle ones cost about 0.8 s of
  CPU each to start (two on a 2-core machine, more on larger ones) and are never used by a recipe;
  a task the run does submit starts its worker on demand;
- :func:`hybridflow.ray_watchdog.guard_local_ray`: the instance does not outlive the run.
"""
from __future__ import annotations

import os

# Ray's own setting (ray_config_def.h) for the prestart above
NO_PRESTART = {"prestart_worker_first_driver": False}


def start_ray(ray_init, runtime_env: dict, log_to_driver: bool = True) -> None:
    """Join ``ray_init.address``, or start a local instance with ``ray_init.num_cpus`` (default:
    every core); nothing when Ray is already initialised (a caller's own instance)."""
    import ray

    if ray.is_initialized():
        return
    if ray_init.address:  # a cluster's settings are its own: _system_config is refused on joining
        ray.init(address=ray_init.address, include_dashboard=False, log_to_driver=log_to_driver,
                 runtime_env=runtime_env)
        return
    ray.init(address="local", num_cpus=ray_init.num_cpus or os.cpu_count(), include_dashboard=False,
             log_to_driver=log_to_driver, runtime_env=runtime_env, _system_config=NO_PRESTART)
    from hybridflow.ray_watchdog import guard_local_ray

    guard_local_ray()
