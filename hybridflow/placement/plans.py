"""A placement plan (which roles share which devices, each role's parallel layout) and its estimate.

Vocabulary (HybridFlow section 6): a *pool* is a set of devices; roles on one pool run one after
another (colocated), roles on disjoint pools run at once. Each role has a training/inference layout
``tp x pp x dp`` (``tp*pp*dp`` = its pool's slots); the actor also has a *generation* layout
(``rollout``: tp_g x dp_g, the 3D-HybridEngine's micro-DP, tp_g dividing the training tp*pp).
The plan space itself is enumerated in ``space.py`` (``enumerate_plans`` here calls it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("actor", "ref", "critic", "reward_model")
RUNTIME_PLACEMENTS = ("colocate", "separate", "colocate+rm-pool", "separate+rm-pool", "colocate+async-rollout")


@dataclass(frozen=True)
class RoleLayout:
    """``fsdp_shard``: over how many of the ``dp`` ranks weights, gradients and optimizer state are
    sharded (FSDP FULL_SHARD / ZeRO-3; 1 = replicated). ``strategy`` "megatron" replicates weights
    and gradients over dp and shards only the optimizer over ``fsdp_shard`` ranks (Megatron's
    distributed optimizer, ZeRO-1); "vllm" is a generation layout (pp = 1, nothing sharded over dp)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    fsdp_shard: int = 1
    strategy: str = "fsdp"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        if self.strategy == "vllm":
            return f"tp{self.tp}xdp{self.dp}"
        s = f"{self.strategy} tp{self.tp}/pp{self.pp}/dp{self.dp}"
        if self.fsdp_shard > 1:  # FSDP: everything sharded; Megatron: the distributed optimizer
            s += f" shard{self.fsdp_shard}" if self.strategy == "fsdp" else f" distopt{self.fsdp_shard}"
        return s


@dataclass(frozen=True)
class Pool:
    """``per_node``: devices the pool takes on each node it spans (the runtime's
    ``trainer.separate_pool_gpus_per_node`` split); 0 = whole nodes (or part of one node)."""

    name: str
    slots: int
    roles: tuple[str, ...]
    per_node: int = 0


def _kind(train: list) -> str:
    if len(train) == 1:
        return "colocate"
    if len(train) >= 3 and all(len(p.roles) == 1 for p in train):
        return "standalone"
    own_rm = [p for p in train if p.roles == ("reward_model",)]
    if own_rm:
        return _kind([p for p in train if p is not own_rm[0]]) + "+rm-pool"
    if len(train) == 2 and set(train[0].roles) <= {"actor", "ref"} and "ref" not in train[1].roles:
        return "split"
    if len(train) == 2 and train[0].roles == ("actor",):
        return "separate"  # the runtime's trainer.placement=separate: actor | ref, critic, RM
    return "+".join("|".join(p.roles) for p in train)


@dataclass(frozen=True)
class Plan:
    """``separate_rollout``: generation runs on a pool of its own (pool name "rollout", role
    "rollout"), with weights sent after each update (hybrid_engine=false, one step off policy);
    otherwise the actor's pool generates in the ``rollout`` layout (the hybrid engine)."""

    pools: tuple[Pool, ...]
    layouts: dict = field(hash=False)  # role -> RoleLayout
    rollout: RoleLayout = RoleLayout(strategy="vllm")
    separate_rollout: bool = False

    def pool_of(self, role: str) -> Pool:
        for p in self.pools:
            if role in p.roles:
                return p
        raise KeyError(role)

    @property
    def placement(self) -> str:
        """HybridFlow's names: colocate (one pool), split (actor+ref | critic+RM), standalone (each
        model its own pool); separate (actor | the rest, the runtime's); "+rm-pool" where the reward
        model has a pool of its own (reward_model.enable_resource_pool); else named by its pools."""
        kind = _kind([p for p in self.pools if p.roles != ("rollout",)])
        return kind + ("+async-rollout" if self.separate_rollout else "")

    @property
    def runnable_here(self) -> bool:
        """Whether this runtime has the placement (trainer.placement=colocate|separate, optionally
        reward_model.enable_resource_pool; or hybrid_engine=false); split and standalone are the
        paper's, planned but not built here."""
        return self.placement in RUNTIME_PLACEMENTS

    def describe(self) -> str:
        parts = []
        for p in self.pools:
            roles = []
            for r in p.roles:
                lay = self.rollout if r == "rollout" else self.layouts[r]
                roles.append(f"{r}[{lay.describe()}]")
            where = f"{p.slots}" + (f"={p.slots // p.per_node}x{p.per_node}/node" if p.per_node else "")
            parts.append(f"{p.name}({where}): " + ", ".join(roles))
        gen = "" if self.separate_rollout else f"; generate {self.rollout.describe()}"
        return f"{self.placement}: " + "; ".join(parts) + gen

    def to_dict(self) -> dict:
        lay = lambda l: dict(tp=l.tp, pp=l.pp, dp=l.dp, fsdp_shard=l.fsdp_shard, strategy=l.strategy)
        return {"placement": self.placement, "runnable_here": self.runnable_here,
                "separate_rollout": self.separate_rollout,
                "pools": [{"name": p.name, "slots": p.slots, "roles": list(p.roles), "per_node": p.per_node}
                          for p in self.pools],
                "layouts": {r: lay(l) for r, l in self.layouts.items()}, "rollout": lay(self.rollout),
                "describe": self.describe()}


@dataclass
class Estimate:
    """The simulator's verdict on one plan. ``stages``: seconds per stage (stage -> s, the critical
    path is ``step_s``); ``memory``: role -> {weights, grads, optimizer, activations, kv_cache,
    total} bytes per device; ``peak_bytes``: pool name -> peak bytes per device on that pool;
    ``reason``: why it is infeasible ("" when feasible), naming the role, needed vs available."""

    plan: Plan
    step_s: float
    stages: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    feasible: bool = True
    reason: str = ""
    peak_bytes: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)  # (stage, pool, start_s, end_s)
    extra: dict = field(default_factory=dict)  # e.g. decode_batch_per_replica

    @property
    def peak(self) -> float:
        return max(self.peak_bytes.values()) if self.peak_bytes else 0.0

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "step_s": self.step_s, "feasible": self.feasible,
                "reason": self.reason, "stages": self.stages, "peak_bytes": self.peak_bytes,
                "memory": self.memory,
                "timeline": [list(t) for t in self.timeline], "extra": self.extra}


def enumerate_plans(workload, cluster) -> list:
    """Every candidate plan for ``workload`` on ``cluster`` (HybridFlow section 6's space, pruned)."""
    from hybridflow.placement.space import enumerate_plans as _enumerate
    return _enumerate(workload, cluster)
