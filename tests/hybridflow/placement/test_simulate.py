"""The step simulator's overlap semantics: disjoint pools run at once, shared pools one after another."""
import dataclasses

import pytest

from hybridflow.placement.cost import Coster
from hybridflow.placement.devices import H100_SXM, Cluster
from hybridflow.placement.plans import Plan, Pool, RoleLayout
from hybridflow.placement.simulate import simulate
from hybridflow.placement.workload import CATALOG, Workload

S = CATALOG["llama-2-7b"]
W = Workload(actor=S, critic=S, reference=True, reward_model=S, prompts=256)
CLUSTER = Cluster(2, 8, H100_SXM)
FSDP8 = RoleLayout(1, 1, 8, 8, "fsdp")
FSDP16 = RoleLayout(1, 1, 16, 8, "fsdp")
ROLES = ("actor", "ref", "critic", "reward_model")


def _spans(est):
    return {name: (pool, start, end) for name, pool, start, end in est.timeline}


def _overlap(a, b):
    return a[1] < b[2] and b[1] < a[2]


def test_colocated_roles_never_overlap():
    plan = Plan((Pool("main", 16, ROLES),), {r: FSDP16 for r in ROLES}, RoleLayout(2, 1, 8, 1, "vllm"))
    est = simulate(plan, Coster(W, CLUSTER))
    assert est.feasible, est.reason
    spans = list(_spans(est).values())
    assert not any(_overlap(a, b) for i, a in enumerate(spans) for b in spans[i + 1:])
    assert est.step_s == pytest.approx(sum(e - s for _, s, e in spans))  # one pool: the step is the sum of its stages


def test_split_pools_overlap_and_the_actor_pool_serialises_generation_and_training():
    plan = Plan((Pool("actor", 8, ("actor", "ref")), Pool("critic", 8, ("critic", "reward_model"))),
                {r: FSDP8 for r in ROLES}, RoleLayout(2, 1, 4, 1, "vllm"))
    est = simulate(plan, Coster(W, CLUSTER))
    assert est.feasible, est.reason
    sp = _spans(est)
    assert _overlap(sp["reward"], sp["old_log_prob"])  # different pools, both after generation
    assert _overlap(sp["update_critic"], sp["update_actor"])
    assert sp["generate"][2] <= sp["reward"][1]  # the critic's pool waits for the sequences
    assert sp["generate"][2] <= sp["old_log_prob"][1] and sp["reshard"][2] <= sp["generate"][1]
    for a, b in (("old_log_prob", "ref"), ("reward", "values")):
        assert not _overlap(sp[a], sp[b])  # same pool
    serial = sum(est.stages.values())
    assert est.step_s < serial


def test_separate_rollout_pool_overlaps_only_when_one_step_off():
    trainer = Pool("main", 8, ROLES)
    plan = Plan((trainer, Pool("rollout", 8, ("rollout",))), {r: FSDP8 for r in ROLES},
                RoleLayout(2, 1, 4, 1, "vllm"), separate_rollout=True)
    turns = simulate(plan, Coster(W, CLUSTER))
    off = simulate(plan, Coster(dataclasses.replace(W, one_step_off=True), CLUSTER))
    gen, sync = turns.stages["generate"], turns.stages["weight_sync"]
    train = sum(v for k, v in turns.stages.items() if k not in ("generate", "weight_sync"))
    assert turns.step_s == pytest.approx(gen + train + sync)  # strictly alternating
    assert off.step_s == pytest.approx(max(gen, train) + sync) and off.step_s < turns.step_s


def test_infeasible_plan_names_the_role_and_the_numbers():
    big = CATALOG["llama-2-70b"]
    w = Workload(actor=big, critic=big, reward_model=big)
    plan = Plan((Pool("main", 8, ROLES),), {r: FSDP8 for r in ROLES}, RoleLayout(8, 1, 1, 1, "vllm"))
    est = simulate(plan, Coster(w, Cluster(1, 8, H100_SXM)))
    assert not est.feasible and est.step_s == float("inf")
    assert est.reason.startswith("actor update on pool main: needs ")
    assert "> 67.1 GiB usable (90% of 80 GB h100)" in est.reason


def test_old_log_prob_stage_is_skipped_when_the_run_skips_it():
    plan = Plan((Pool("main", 16, ROLES),), {r: FSDP16 for r in ROLES}, RoleLayout(2, 1, 8, 1, "vllm"))
    with_it = simulate(plan, Coster(W, CLUSTER))
    without = simulate(plan, Coster(dataclasses.replace(W, old_log_prob=False), CLUSTER))
    assert "old_log_prob" in with_it.stages and "old_log_prob" not in without.stages
    assert without.step_s == pytest.approx(with_it.step_s - with_it.stages["old_log_prob"])


def test_placement_names():
    lay = {r: FSDP8 for r in ROLES}
    name = lambda *pools, sep=False: Plan(tuple(Pool(f"p{i}", 8, r) for i, r in enumerate(pools)), lay,
                                          separate_rollout=sep).placement
    assert name(ROLES) == "colocate"
    assert name(("actor", "ref"), ("critic", "reward_model")) == "split"
    assert name(("actor",), ("ref", "critic", "reward_model")) == "separate"
    assert name(("actor",), ("ref",), ("critic",), ("reward_model",)) == "standalone"
    assert name(("actor", "ref", "critic"), ("reward_model",)) == "colocate+rm-pool"
    assert name(("actor",), ("ref", "critic"), ("reward_model",)) == "separate+rm-pool"
    assert name(ROLES, ("rollout",), sep=True) == "colocate+async-rollout"
