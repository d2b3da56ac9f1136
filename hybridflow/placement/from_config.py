"""The planner's inputs from a run's config, and a plan back as the config values the runtime runs.

``workload_from_config``: the models' shapes from their ``config.json`` (actor, critic, reward
model), the batch keys (prompts, samples, lengths, epochs, mini-batches, micro-batch), dtypes.
``cluster_from_config``: ``trainer.nnodes`` x the slots per node (``n_gpus_per_node``, or what this
machine offers), with a device profile (calibrated on CPU). ``apply_plan``: Hydra overrides
(``key=value``) that make the runtime run a plan, or ``LocalPlanError`` naming why it cannot: only
the placements and layouts the runtime builds are candidates for ``trainer.placement=auto``.
"""
from __future__ import annotations

import os

from hybridflow.model_files import read_json
from hybridflow.placement.devices import Cluster, DeviceProfile
from hybridflow.placement.plans import Plan, RoleLayout
from hybridflow.placement.workload import ModelShape, Workload

ARR = "actor_rollout_ref"


class LocalPlanError(ValueError):
    """A plan this runtime cannot run (the reason names what is missing)."""


def _shape(path: str, name: str) -> ModelShape:
    # read_json: a corrupt config.json fails in one line naming it, as everywhere else
    return ModelShape.from_hf_config(read_json(os.path.join(path, "config.json")), name=name)


def workload_from_config(cfg) -> Workload:
    """One PPO step of ``cfg`` (a resolved RootConfig) as the planner's Workload."""
    from hybridflow.config.resolve import critic_model_path, needs_critic, needs_reference

    arr, data = cfg.actor_rollout_ref, cfg.data
    actor = _shape(arr.model.path, "actor")
    critic = _shape(critic_model_path(cfg), "critic") if needs_critic(cfg) else None
    rm = _shape(cfg.reward_model.model.path, "reward_model") if cfg.reward_model.enable else None
    a = arr.actor
    mini = a.ppo_mini_batch_size
    bytes_of = {"bf16": 2, "fp32": 4}
    role_bytes = {"reward_model": 4} if rm is not None else {}  # workers/reward_model.py computes in fp32
    if critic is not None and cfg.critic.param_dtype in bytes_of:
        role_bytes["critic"] = bytes_of[cfg.critic.param_dtype]
    kwargs = dict(actor=actor, critic=critic, reference=needs_reference(cfg), reward_model=rm,
                  prompts=data.train_batch_size, samples_per_prompt=arr.rollout.n,
                  prompt_len=data.max_prompt_length, response_len=data.max_response_length,
                  ppo_epochs=a.ppo_epochs, mini_batches=max(1, data.train_batch_size // mini),
                  param_bytes=bytes_of.get(a.param_dtype, 2), micro_batch=a.ppo_micro_batch_size_per_gpu,
                  recompute=bool(arr.model.enable_gradient_checkpointing))
    return Workload(**kwargs, old_log_prob=a.recompute_old_log_prob != "skip", one_step_off=False,
                    extra={"role_bytes": role_bytes})


def local_slots(cfg) -> int:
    """Worker slots the plan may use here: CPU cores / trainer.cpus_per_worker (or GPUs)."""
    from hybridflow import device

    if device.uses_gpu(cfg.trainer.device):
        return device.device_count()
    return max(1, int((cfg.ray_init.num_cpus or os.cpu_count() or 1) / cfg.trainer.cpus_per_worker + 1e-9))


def cluster_from_config(cfg, device: DeviceProfile, slots_per_node: int | None = None) -> Cluster:
    """``trainer.nnodes`` nodes of ``slots_per_node`` slots (default: what this machine offers)."""
    return Cluster(cfg.trainer.nnodes, slots_per_node or local_slots(cfg), device)


def _fsdp_size(lay: RoleLayout) -> int:
    """fsdp_size: 1 replicates (DDP), the dp size shards over all ranks (-1), k in between (HSDP)."""
    return -1 if lay.fsdp_shard == lay.dp and lay.dp > 1 else lay.fsdp_shard


def _role_overrides(prefix: str, fsdp_prefix: str, lay: RoleLayout, role: str) -> list[str]:
    if lay.strategy == "fsdp":
        if lay.tp != 1 or lay.pp != 1:
            raise LocalPlanError(f"{role}: fsdp with tp/pp > 1 is not a runtime layout")
        return [f"{prefix}.strategy=fsdp", f"{fsdp_prefix}.fsdp_config.fsdp_size={_fsdp_size(lay)}"]
    if lay.strategy == "megatron":
        return [f"{prefix}.strategy=megatron", f"{prefix}.megatron.tensor_model_parallel_size={lay.tp}",
                f"{prefix}.megatron.pipeline_model_parallel_size={lay.pp}"]
    raise LocalPlanError(f"{role}: strategy {lay.strategy} is not a training strategy here")


def apply_plan(cfg, plan: Plan) -> list[str]:
    """Hydra overrides that run ``plan`` with ``cfg``'s models and batch on ``trainer.nnodes`` nodes.
    Raises LocalPlanError for a placement or layout the runtime does not build."""
    kind = plan.placement
    nodes = cfg.trainer.nnodes
    lay = plan.layouts
    out = []
    if plan.separate_rollout:
        raise LocalPlanError("a rollout pool of its own runs one step off policy (async_training): not chosen "
                             "automatically for an on-policy recipe")
    if any(p.slots % nodes for p in plan.pools):
        raise LocalPlanError(f"a pool of {[p.slots for p in plan.pools]} slots does not split over {nodes} nodes")
    pools = {p.name: p for p in plan.pools}
    reward = pools.pop("reward", None)
    base = kind.replace("+rm-pool", "")
    if base == "colocate" and len(pools) == 1:
        (main,) = pools.values()
        out += ["trainer.placement=colocate", f"trainer.n_gpus_per_node={main.slots // nodes}"]
    elif base == "separate" and len(pools) == 2:
        main, side = plan.pools[0], plan.pools[1]
        out += ["trainer.placement=separate", f"trainer.n_gpus_per_node={main.slots // nodes}",
                f"trainer.separate_pool_gpus_per_node={side.slots // nodes}"]
    else:
        raise LocalPlanError(f"placement {kind} is planned but not built here (colocate and separate, each with "
                             "or without a reward model pool, are)")
    # the slots were counted and calibrated at this many cores each (trainer.n_gpus_per_node=auto may
    # have set it at load): the plan's worker counts only hold with it
    out.append(f"trainer.cpus_per_worker={cfg.trainer.cpus_per_worker:g}")
    if reward is not None:
        out += ["reward_model.enable_resource_pool=true", f"reward_model.nnodes={nodes}",
                f"reward_model.n_gpus_per_node={reward.slots // nodes}"]
    else:
        out += ["reward_model.enable_resource_pool=false"]
    a = lay["actor"]
    out += _role_overrides(f"{ARR}.actor", f"{ARR}.actor", a, "actor")
    if "ref" in lay:
        r = lay["ref"]
        if r.strategy != a.strategy or (a.strategy == "megatron" and (r.tp, r.pp) != (a.tp, a.pp)):
            raise LocalPlanError("ref: the reference runs in the actor's strategy and Megatron sizes here")
        if r.strategy == "fsdp":
            if r.tp != 1 or r.pp != 1:
                raise LocalPlanError("ref: fsdp with tp/pp > 1 is not a runtime layout")
            out.append(f"{ARR}.ref.fsdp_config.fsdp_size={_fsdp_size(r)}")
    if "critic" in lay:
        c = lay["critic"]
        if (c.strategy == a.strategy == "megatron" and (c.tp, c.pp) != (a.tp, a.pp)
                and plan.pool_of("critic") is plan.pool_of("actor")):
            raise LocalPlanError("critic: colocated with the actor it shares its process, which holds one "
                                 "Megatron layout (the actor's sizes)")
        out += _role_overrides("critic", "critic.model", c, "critic")
    if "reward_model" in lay:
        rm = lay["reward_model"]
        if rm.tp != 1 or rm.pp != 1 or rm.fsdp_shard != 1:
            raise LocalPlanError("reward_model: the reward model worker runs replicated (tp = pp = 1, unsharded)")
    if a.strategy == "megatron" and a.tp % plan.rollout.tp:
        raise LocalPlanError(f"rollout tp{plan.rollout.tp} must divide the actor's Megatron tp{a.tp} here (the "
                             "hybrid engine regroups each training TP group, not across pipeline stages)")
    out.append(f"{ARR}.rollout.tensor_model_parallel_size={plan.rollout.tp}")
    return out


def user_overrides_replaced(given: list[str], planned: list[str]) -> list[str]:
    """The user's ``key=value`` overrides that the plan sets to something else (said on stderr)."""
    plan_keys = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in planned}
    out = []
    for o in given:
        key = o.lstrip("+~").split("=", 1)[0]
        if key in plan_keys and "=" in o and o.split("=", 1)[1] != plan_keys[key]:
            out.append(f"{o} (plan: {key}={plan_keys[key]})")
    return out
