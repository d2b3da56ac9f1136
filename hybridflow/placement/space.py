"""The plan space (HybridFlow section 6) and how it is pruned.

Placements: **colocate** (every role on all devices); **split** (actor+ref | critic+reward model,
the paper's); **separate** (actor | ref+critic+reward model, split on every node, what
``trainer.placement=separate`` runs); **rm-pool** (the reward model on a pool of its own,
``reward_model.enable_resource_pool``, the rest colocated or separate); **standalone** (each model a
pool of its own); and **async-rollout** (generation on a pool of its own, the trainer roles
colocated on the rest: ``actor_rollout_ref.hybrid_engine=false``). Pool sizes are whole nodes on several nodes, any split
on one node (Algorithm 1 enumerates allocations the same way).

Per role and pool size, the layouts: FSDP (sharded over the pool, within a node, or replicated) and
Megatron tp x pp x dp (tp within a node dividing the heads, pp dividing the layers, at most
``MAX_PP``). The actor adds its generation layout tp_g x dp_g (3D-HybridEngine: tp_g divides the
training model-parallel size tp*pp for Megatron, so each micro-DP group gathers within its own
training group; any tp_g within a node for FSDP).

Pruning (exact for time within a pool, heuristic across pools): a role's layouts are costed once
per pool shape; only those on the (time, resident memory, transient memory) Pareto front survive,
at most ``KEEP_LAYOUTS`` (fastest first, the leanest always kept). On a pool, the combinations of
its roles' survivors are checked for memory exactly (simulate.pool_memory) and ranked by the sum
of their stage times (they serialise on the pool); the best ``KEEP_COMBOS`` feasible (one on a pool
of a single role; or the leanest infeasible one, to report why) go on to the full simulation,
crossed with the other pools'.
"""
from __future__ import annotations

import itertools
import math

from hybridflow.placement.cost import TRAINED, Coster, resident_bytes
from hybridflow.placement.plans import Plan, Pool, RoleLayout
from hybridflow.placement.simulate import pool_memory

MAX_PP = 16  # deeper pipelines leave < 3 Llama-70B layers a stage and bubbles grow with pp (Narayanan 2021)
KEEP_LAYOUTS = 6
KEEP_COMBOS = 3


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _limit(pool: Pool, slots_per_node: int) -> int:
    return max(1, min(pool.slots, pool.per_node or slots_per_node))


def role_layouts(coster: Coster, role: str, pool: Pool) -> list[RoleLayout]:
    shape, n = coster.w.model_of(role), pool.slots
    lim = _limit(pool, coster.c.slots_per_node)
    out = {RoleLayout(1, 1, n, s, "fsdp") for s in {n, 1, lim if n % lim == 0 else n}}
    for tp in _divisors(lim):
        if n % tp or shape.heads % tp:
            continue
        for pp in _divisors(n // tp):
            if pp <= MAX_PP and shape.layers % pp == 0 and tp * pp > 1:
                dp = n // (tp * pp)  # trained roles shard the optimizer over dp; inference roles have none
                out.add(RoleLayout(tp, pp, dp, dp if role in TRAINED else 1, "megatron"))
    return sorted(out, key=lambda l: (l.strategy, l.tp, l.pp, l.fsdp_shard))


def rollout_layouts(coster: Coster, pool: Pool, train: RoleLayout | None) -> list[RoleLayout]:
    """Generation layouts on ``pool``: with ``train`` (hybrid engine) tp_g follows the training layout."""
    lim, heads = _limit(pool, coster.c.slots_per_node), coster.w.actor.heads
    if train is not None and train.strategy == "megatron":
        tps = [t for t in _divisors(train.tp * train.pp) if t <= lim]
    else:
        tps = [t for t in _divisors(lim) if pool.slots % t == 0]
    return [RoleLayout(t, 1, pool.slots // t, 1, "vllm") for t in tps if heads % t == 0]


def _pareto(items: list, keys) -> list:
    """Items not dominated on every key (all minimised)."""
    vals = [tuple(k(it) for k in keys) for it in items]
    keep = []
    for i, v in enumerate(vals):
        if not any(all(o[j] <= v[j] for j in range(len(v))) and o != v for o in vals):
            keep.append(items[i])
    return keep


class Space:
    """Enumerates plans for one workload on one cluster, caching each role's costs per pool shape."""

    def __init__(self, coster: Coster, placements=None, strategies=None):
        """``placements``: the placement names to consider (default all: colocate, split, separate,
        rm-pool, standalone, async-rollout); ``strategies``: training layouts to consider (fsdp, megatron).
        The runtime here runs colocate, separate, rm-pool and async-rollout (trainer.placement=auto asks
        for those)."""
        self.k = coster
        self.only = set(placements) if placements else None
        self.strategies = set(strategies) if strategies else None
        self.stats = {"layouts_costed": 0, "pool_combos_checked": 0, "allocations": 0}
        self._role_cache = {}

    # -- placements --------------------------------------------------------------------------------
    def placements(self):
        """(name, pools, separate_rollout) for every placement and allocation."""
        c, roles = self.k.c, self.k.w.roles
        total, spn = c.slots, c.slots_per_node
        step = spn if c.nodes > 1 else 1
        sizes = list(range(step, total, step))
        yield "colocate", (Pool("main", total, roles),), False
        a_roles = tuple(r for r in roles if r in ("actor", "ref"))
        b_roles = tuple(r for r in roles if r in ("critic", "reward_model"))
        if b_roles:
            for a in sizes:
                yield "split", (Pool("actor", a, a_roles), Pool("critic", total - a, b_roles)), False
        side = tuple(r for r in roles if r != "actor")
        if side and side != b_roles and spn > 1:
            for s in range(1, spn):
                yield "separate", (Pool("main", c.nodes * (spn - s), ("actor",), spn - s if c.nodes > 1 else 0),
                                   Pool("side", c.nodes * s, side, s if c.nodes > 1 else 0)), False
        if "reward_model" in roles and len(roles) > 1:  # reward_model.enable_resource_pool
            rest = tuple(r for r in roles if r != "reward_model")
            for r in sizes:
                yield "rm-pool", (Pool("main", total - r, rest), Pool("reward", r, ("reward_model",))), False
            side = tuple(x for x in rest if x != "actor")
            if side and spn > 1:  # ... beside trainer.placement=separate on the other slots
                for r in sizes:
                    nodes = (total - r) // spn if c.nodes > 1 else 1
                    per = spn if c.nodes > 1 else total - r
                    for s in range(1, per):
                        yield "rm-pool", (Pool("main", nodes * (per - s), ("actor",), per - s if c.nodes > 1 else 0),
                                          Pool("side", nodes * s, side, s if c.nodes > 1 else 0),
                                          Pool("reward", r, ("reward_model",))), False
        if len(roles) >= 3:
            units = total // step
            for cuts in itertools.combinations(range(1, units), len(roles) - 1):
                parts = [b - a for a, b in zip((0,) + cuts, cuts + (units,))]
                yield "standalone", tuple(Pool(r, p * step, (r,)) for r, p in zip(roles, parts)), False
        for r in sizes:
            yield "async-rollout", (Pool("main", total - r, roles), Pool("rollout", r, ("rollout",))), True

    # -- per role ----------------------------------------------------------------------------------
    def role_candidates(self, role: str, pool: Pool) -> list[tuple]:
        """[(layout, seconds of its non-generation stages, resident bytes, transient bytes)], pruned."""
        key = (role, pool.slots, pool.per_node)
        if key in self._role_cache:
            return self._role_cache[key]
        k, rows = self.k, []
        trained = role in TRAINED
        for lay in role_layouts(k, role, pool):
            if self.strategies and lay.strategy not in self.strategies:
                continue
            self.stats["layouts_costed"] += 1
            fwd = role != "actor" or k.w.old_log_prob  # the actor's forward is pi_old's recompute
            sec = (k.forward_s(role, lay, pool) if fwd else 0.0) + (k.train_s(role, lay, pool) if trained else 0.0)
            st = k.state_bytes(role, lay, trained)
            res = resident_bytes(st, lay)
            rows.append((lay, sec, res, sum(st.values()) - res + k.activation_bytes(role, lay, trained)))
        front = _pareto(rows, (lambda r: r[1], lambda r: r[2], lambda r: r[3]))
        front.sort(key=lambda r: r[1])
        keep = front[:KEEP_LAYOUTS]
        lean = min(rows, key=lambda r: (r[2] + r[3], r[1]))
        if lean not in keep:
            keep.append(lean)
        if role == "actor":  # keep the fastest per model-parallel size: it bounds the generation tp
            by_mp = {}
            for r in sorted(front, key=lambda r: r[1]):
                by_mp.setdefault((r[0].strategy, r[0].tp * r[0].pp), r)
            keep += [r for r in by_mp.values() if r not in keep]
        self._role_cache[key] = keep
        return keep

    # -- per pool ----------------------------------------------------------------------------------
    def pool_combos(self, pool: Pool, separate_rollout: bool) -> list[tuple]:
        """[(feasible, pool seconds, layouts dict, rollout layout or None, reason)], best first."""
        k = self.k
        if pool.roles == ("rollout",):
            out = []
            for ro in rollout_layouts(k, pool, None):
                plan = Plan((pool,), {}, ro, True)
                _, why, free, _ = pool_memory(k, plan, pool)
                sec = k.generate_s(ro, free, pool)[0] if not why else math.inf
                out.append((not why, sec, {}, ro, why))
            return self._best(out, 1)
        roles = pool.roles
        lists = [self.role_candidates(r, pool) for r in roles]
        out = []
        for combo in itertools.product(*lists):
            layouts = {r: row[0] for r, row in zip(roles, combo)}
            base = sum(row[1] for row in combo)
            gens = [None]
            if "actor" in roles and not separate_rollout:
                gens = rollout_layouts(k, pool, layouts["actor"])
            for ro in gens:
                self.stats["pool_combos_checked"] += 1
                plan = Plan((pool,), layouts, ro or RoleLayout(strategy="vllm"), separate_rollout)
                _, why, free, mems = pool_memory(k, plan, pool)
                sec = base
                if ro is not None and not why:
                    sec += k.generate_s(ro, free, pool)[0] + k.reshard_s(layouts["actor"], ro, pool)
                lean = sum(m.get("total", 0.0) for m in mems.values())
                out.append((not why, sec if not why else lean, layouts, ro, why))
        # a pool of one role keeps only its fastest: its stages meet no other role's on the pool
        return self._best(out, 1 if len(roles) == 1 else KEEP_COMBOS)

    @staticmethod
    def _best(rows: list, keep: int = KEEP_COMBOS) -> list:
        ok = sorted((r for r in rows if r[0]), key=lambda r: r[1])
        if ok:
            return ok[:keep]
        return sorted(rows, key=lambda r: r[1])[:1]  # the leanest infeasible, to say why

    # -- plans -------------------------------------------------------------------------------------
    def plans(self):
        """Every (placement name, Plan) that goes on to the full simulation."""
        for name, pools, sep in self.placements():
            if self.only and name not in self.only:
                continue
            self.stats["allocations"] += 1
            per_pool = [self.pool_combos(p, sep) for p in pools]
            for choice in itertools.product(*per_pool):
                layouts, rollout = {}, RoleLayout(strategy="vllm")
                for row in choice:
                    layouts.update(row[2])
                    if row[3] is not None:
                        rollout = row[3]
                yield name, Plan(tuple(pools), layouts, rollout, sep)


def enumerate_plans(workload, cluster, coster: Coster | None = None) -> list[Plan]:
    return [p for _, p in Space(coster or Coster(workload, cluster)).plans()]
