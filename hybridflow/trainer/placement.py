"""Where each role runs: one colocated pool (the hybrid engine, the default) or separate pools.

``colocate``: every role (actor+rollout+ref, critic, reward model) lives in one process per slot,
sharing the device; the roles are addressed through per-role views of one worker group.
``separate``: actor+rollout keep the main pool; ref, critic and reward model share a second pool
of ``trainer.separate_pool_gpus_per_node`` slots per node, so they can run while the actor works.
The recipe supplies the worker classes (the core never imports ``workers``).
"""
from __future__ import annotations

from hybridflow.controller import (RayClassWithInitArgs, RayWorkerGroup, ResourcePool,
                                   create_colocated_worker_cls)


def build_worker_groups(cfg, main_roles: dict[str, RayClassWithInitArgs],
                        side_roles: dict[str, RayClassWithInitArgs], use_gpu: bool) -> tuple[dict, list]:
    """Create and return ({role: WorkerGroup view}, [pools]). ``main_roles`` go on the main pool;
    ``side_roles`` go on it too when colocated, on their own pool when separate."""
    t = cfg.trainer
    pools = [ResourcePool([t.n_gpus_per_node] * t.nnodes, use_gpu=use_gpu, cpus_per_slot=t.cpus_per_worker,
                          name_prefix="main")]
    plan = [(pools[0], dict(main_roles))]
    if side_roles:
        if t.placement == "separate":
            side = ResourcePool([t.separate_pool_gpus_per_node] * t.nnodes, use_gpu=use_gpu,
                                cpus_per_slot=t.cpus_per_worker, name_prefix="side")
            pools.append(side)
            plan.append((side, dict(side_roles)))
        else:
            plan[0][1].update(side_roles)
    groups = {}
    for pool, roles in plan:
        group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix=pool.name_prefix,
                               timeout_s=t.call_timeout_s)
        groups.update(group.spawn(list(roles)))
    return groups, pools
