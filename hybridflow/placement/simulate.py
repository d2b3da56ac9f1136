"""One PPO step of a plan, simulated: memory per pool, then the stages' schedule.

The dataflow (verl's ``RayPPOTrainer.fit`` order, HybridFlow figure 1):

    [reshard ->] generate -> reward, old_log_prob, ref, values -> update_critic, update_actor [-> weight_sync]

A stage starts once its inputs are done and its pool is free: roles on one pool run one after
another (colocated), roles on disjoint pools at once. The actor's generation and training share
the actor's devices, so they serialise (the hybrid engine reshards in between). With a rollout pool
of its own and ``workload.one_step_off``, generation of the next batch overlaps this batch's
training and only the weight sync is on both (verl's one-step-off trainer): a step is then
max(generate, training) + sync; without it the pools take turns.
"""
from __future__ import annotations

import math

from hybridflow.placement.cost import TRAINED, Coster, resident_bytes, role_memory
from hybridflow.placement.plans import Estimate, Plan, Pool

GiB = 2 ** 30


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def pool_memory(coster: Coster, plan: Plan, pool: Pool) -> tuple[float, str, float, dict]:
    """(peak bytes per device, reason if it does not fit else "", KV bytes free for generation,
    role -> memory dict). Resident on a pool: every role's weights and optimizer state; transient,
    one stage at a time: a trained role's gradients (FSDP; Megatron's stay resident) + activations,
    an inference role's activations,
    or generation's extra weights + KV cache (at least one full-length sequence)."""
    k, dev = coster.k, coster.c.device
    usable = dev.mem_bytes * k.mem_usable
    mems = {r: role_memory(coster, plan, r) for r in pool.roles}
    resident = {r: resident_bytes(m, plan.layouts.get(r)) for r, m in mems.items()}
    res_total = sum(resident.values())
    transients = []  # (label, bytes needed at least, bytes used, parts)
    for r in pool.roles:
        m = mems[r]
        if r == "rollout":
            kv_free = usable - res_total
            kv_min = coster.kv_per_seq(plan.rollout.tp)
            transients.append(("generation (rollout pool)", kv_min, min(m["kv_cache"], max(kv_free, kv_min)),
                               f"KV cache for one {coster.w.seq_len}-token sequence {_gib(kv_min)}"))
            continue
        if r in TRAINED and plan.layouts[r].strategy == "megatron":
            t = m["activations"]
            transients.append((f"{r} update", t, t, f"activations {_gib(t)}"))
        elif r in TRAINED:
            t = m["grads"] + m["activations"]
            transients.append((f"{r} update", t, t,
                               f"grads {_gib(m['grads'])} + activations {_gib(m['activations'])}"))
        else:
            t = m["activations"]
            transients.append((f"{r} forward", t, t, f"activations {_gib(t)}"))
    kv_free = 0.0
    if "actor" in pool.roles and not plan.separate_rollout:
        gen = role_memory(coster, plan, "rollout")
        # 3D-HybridEngine (Megatron): the generation shard reuses the training shard's memory
        # (zero redundancy); FSDP keeps its shards and the rollout holds its own tp_g copy.
        extra = gen["weights"]
        if plan.layouts["actor"].strategy == "megatron":
            extra = max(0.0, gen["weights"] - mems["actor"]["weights"])
        kv_free = usable - res_total - extra
        kv_min = coster.kv_per_seq(plan.rollout.tp)
        mems["rollout"] = dict(gen, kv_cache=min(gen["kv_cache"], max(kv_free, kv_min)))
        transients.append(("actor generation", extra + kv_min, extra + mems["rollout"]["kv_cache"],
                           f"rollout weights (tp{plan.rollout.tp}) beyond the training shard {_gib(extra)}"
                           f" + KV cache for one {coster.w.seq_len}-token sequence {_gib(kv_min)}"))
    elif "rollout" in pool.roles:
        kv_free = usable - res_total
        mems["rollout"]["kv_cache"] = min(mems["rollout"]["kv_cache"], max(kv_free, 0.0))
    for m in mems.values():
        m["total"] = sum(v for key, v in m.items() if key != "total")
    peak = res_total + max((used for _, _, used, _ in transients), default=0.0)
    for label, need, _, parts in transients:
        if res_total + need > usable:
            res_parts = ", ".join(f"{r} {_gib(v)}" for r, v in resident.items())
            reason = (f"{label} on pool {pool.name}: needs {_gib(res_total + need)} GiB/device (resident "
                      f"state: {res_parts}; {parts}) > {_gib(usable)} GiB usable "
                      f"({k.mem_usable:.0%} of {dev.mem_bytes / 1e9:.0f} GB {dev.name})")
            return max(peak, res_total + need), reason, kv_free, mems
    return peak, "", kv_free, mems


def simulate(plan: Plan, coster: Coster) -> Estimate:
    """Estimate one PPO step of ``plan``: infeasible (with the memory reason) or its schedule."""
    w = coster.w
    peaks, memory, kv_free, reason = {}, {}, 0.0, ""
    for pool in plan.pools:
        peak, why, free, mems = pool_memory(coster, plan, pool)
        peaks[pool.name] = peak
        memory.update(mems)
        if why and not reason:
            reason = why
        if "actor" in pool.roles and not plan.separate_rollout or "rollout" in pool.roles:
            kv_free = free
    if reason:
        return Estimate(plan, math.inf, {}, memory, False, reason, peaks)

    actor_pool = plan.pool_of("actor")
    gen_pool = plan.pool_of("rollout") if plan.separate_rollout else actor_pool
    gen_s, batch = coster.generate_s(plan.rollout, kv_free, gen_pool)
    stages = []  # (name, pools, seconds, deps)
    if plan.separate_rollout:
        stages.append(("generate", (gen_pool.name,), gen_s, ()))
    else:
        stages.append(("reshard", (actor_pool.name,),
                       coster.reshard_s(plan.layouts["actor"], plan.rollout, actor_pool), ()))
        stages.append(("generate", (actor_pool.name,), gen_s, ("reshard",)))
    post = []
    for name, role in (("reward", "reward_model"), ("old_log_prob", "actor"), ("ref", "ref"), ("values", "critic")):
        if role in plan.layouts and (name != "old_log_prob" or w.old_log_prob):
            pool = plan.pool_of(role)
            stages.append((name, (pool.name,), coster.forward_s(role, plan.layouts[role], pool), ("generate",)))
            post.append(name)
    for name, role in (("update_critic", "critic"), ("update_actor", "actor")):
        if role in plan.layouts:
            pool = plan.pool_of(role)
            stages.append((name, (pool.name,), coster.train_s(role, plan.layouts[role], pool), tuple(post)))
    if plan.separate_rollout:
        same_node = coster.c.nodes == 1
        stages.append(("weight_sync", (actor_pool.name, gen_pool.name),
                       coster.weight_sync_s(plan.rollout, same_node), ("update_actor",)))

    overlap = plan.separate_rollout and w.one_step_off
    timeline = _schedule(stages, skip_generate=overlap)
    if overlap:
        # steady state of one step off: the trainer's step (without generation) runs beside the next
        # batch's generation; both wait for the weight sync at the end.
        sync = next(s for s in stages if s[0] == "weight_sync")[2]
        train = max(end for name, _, _, end in timeline if name != "weight_sync") if timeline else 0.0
        step = max(gen_s, train) + sync
        timeline.insert(0, ("generate", gen_pool.name, 0.0, gen_s))
    else:
        step = max(end for *_, end in timeline)
    est = Estimate(plan, step, {name: sec for name, _, sec, _ in stages}, memory, True, "", peaks, timeline)
    est.extra["decode_batch_per_replica"] = batch
    return est


def _schedule(stages, skip_generate: bool) -> list:
    """List scheduling in program order: start = max(inputs done, every pool it uses free)."""
    free, done, timeline = {}, {}, []
    for name, pools, sec, deps in stages:
        if skip_generate and name == "generate":
            done[name] = 0.0
            continue
        start = max([done.get(d, 0.0) for d in deps] + [free.get(p, 0.0) for p in pools] + [0.0])
        end = start + sec
        done[name] = end
        for p in pools:
            free[p] = end
        timeline.append((name, pools[0] if len(pools) == 1 else "+".join(pools), start, end))
    return timeline
