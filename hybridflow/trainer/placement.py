"""Where each role runs: one colocated pool (the hybrid engine, the default) or separate pools.

``colocate``: every role (actor+rollout+ref, critic, reward model) lives in one process per slot,
sharing the device; the roles are addressed through per-role views of one worker group.
``separate``: actor+rollout keep the main pool; ref, critic and reward model share a second pool
of ``trainer.separate_pool_gpus_per_node`` slots per node, so they can run while the actor works.
``reward_model.enable_resource_pool`` (verl's keys) gives the reward model a pool of its own,
``reward_model.nnodes x reward_model.n_gpus_per_node`` slots, under either placement; and
``actor_rollout_ref.hybrid_engine=false`` the rollout (role ``rollout``), ``rollout.nnodes x
rollout.n_gpus_per_node`` slots (trainer/async_rollout.py).
The recipe supplies the worker classes (the core never imports ``workers``).
"""
from __future__ import annotations

from hybridflow.controller import (RayClassWithInitArgs, RayWorkerGroup, ResourcePool,
                                   create_colocated_worker_cls)


def build_worker_groups(cfg, main_roles: dict[str, RayClassWithInitArgs],
                        side_roles: dict[str, RayClassWithInitArgs], use_gpu: bool) -> tuple[dict, list]:
    """Create and return ({role: WorkerGroup view}, [pools]). ``main_roles`` go on the main pool;
    ``side_roles`` go on it too when colocated, on their own pool when separate; the reward model
    on a pool of its own when it asks for one, and so does ``rollout`` (hybrid_engine=false)."""
    t, rm = cfg.trainer, cfg.reward_model
    side_roles = dict(side_roles)
    plan = [("main", [t.n_gpus_per_node] * t.nnodes, dict(main_roles))]
    own = {}  # the reward model's own pool
    if rm.enable_resource_pool and "reward_model" in side_roles:
        own["reward_model"] = side_roles.pop("reward_model")
    rollout = {"rollout": side_roles.pop("rollout")} if "rollout" in side_roles else {}
    if side_roles and t.placement == "separate":
        plan.append(("side", [t.separate_pool_gpus_per_node] * t.nnodes, side_roles))
    elif side_roles:
        plan[0][2].update(side_roles)
    if own:
        plan.append(("reward", [rm.n_gpus_per_node] * rm.nnodes, own))
    if rollout:
        plan.append(("rollout", [cfg.rollout.n_gpus_per_node] * cfg.rollout.nnodes, rollout))
    groups, pools = {}, []
    for name, slots, roles in plan:
        pool = ResourcePool(slots, use_gpu=use_gpu, cpus_per_slot=t.cpus_per_worker, name_prefix=name)
        pools.append(pool)
        group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix=name, timeout_s=t.call_timeout_s,
                               init_timeout_s=t.init_timeout_s)
        groups.update(group.spawn(list(roles)))
    return groups, pools
