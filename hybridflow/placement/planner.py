"""Plan a workload on a cluster: enumerate the pruned plan space, simulate each plan, rank them.

HybridFlow's Algorithm 1 in outline: for each placement and device allocation, pick each model's
fastest parallel strategy that fits, simulate the step, keep the fastest. Here every surviving
combination is simulated (space.py says how the space is pruned) and all are returned: feasible
ones by predicted step time, infeasible ones after, each with the memory reason.

``calibration`` (what ``calibrate.py`` measures on the machine in hand) may be a ``DeviceProfile``
(replaces the cluster's device), a dict of ``cost.Constants`` overrides, or a dict with both:
``{"device": DeviceProfile, "constants": {...}}``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from hybridflow.placement.cost import DEFAULT, Coster, Constants, with_overrides
from hybridflow.placement.devices import Cluster, DeviceProfile
from hybridflow.placement.plans import Estimate
from hybridflow.placement.simulate import simulate
from hybridflow.placement.space import Space
from hybridflow.placement.workload import Workload


@dataclass
class PlanResult:
    estimates: list  # feasible by step_s, then infeasible
    seconds: float  # wall time the planning took
    stats: dict = field(default_factory=dict)

    @property
    def feasible(self) -> list:
        return [e for e in self.estimates if e.feasible]

    @property
    def best(self) -> Estimate | None:
        return self.feasible[0] if self.feasible else None

    def rejected_by_reason(self) -> dict:
        """Infeasible plans counted by what did not fit ("actor update on pool main", ...)."""
        out = {}
        for e in self.estimates:
            if not e.feasible:
                key = e.reason.split(":", 1)[0]
                out[key] = out.get(key, 0) + 1
        return out


def _resolve(cluster: Cluster, calibration) -> tuple[Cluster, Constants]:
    consts = DEFAULT
    if calibration is None:
        return cluster, consts
    if isinstance(calibration, DeviceProfile):
        return replace(cluster, device=calibration), consts
    if isinstance(calibration, dict):
        device = calibration.get("device")
        overrides = calibration.get("constants")
        if device is None and overrides is None:
            overrides = calibration
        if device is not None:
            cluster = replace(cluster, device=device)
        return cluster, with_overrides(consts, overrides)
    raise TypeError(f"calibration must be a DeviceProfile or a dict, not {type(calibration).__name__}")


def plan(workload: Workload, cluster: Cluster, calibration=None, placements=None, strategies=None) -> PlanResult:
    """``placements``/``strategies`` restrict the space (see ``space.Space``), e.g. to what the
    runtime runs: ``placements=("colocate", "separate", "rm-pool", "async-rollout")``."""
    t0 = time.perf_counter()
    cluster, consts = _resolve(cluster, calibration)
    coster = Coster(workload, cluster, consts)
    space = Space(coster, placements, strategies)
    estimates, seen = [], set()
    for _name, p in space.plans():
        key = p.describe()
        if key in seen:
            continue
        seen.add(key)
        estimates.append(simulate(p, coster))
    # ties in step time (layouts that differ only in memory) go to the plan that needs less memory
    estimates.sort(key=lambda e: (not e.feasible, e.step_s if e.feasible else 0.0, e.peak))
    stats = dict(space.stats, plans_simulated=len(estimates),
                 feasible=sum(e.feasible for e in estimates))
    return PlanResult(estimates, time.perf_counter() - t0, stats)


def plan_all(workload: Workload, cluster: Cluster, calibration=None, **restrict) -> list[Estimate]:
    """Every simulated plan: feasible ones fastest first, then the infeasible with their reasons."""
    return plan(workload, cluster, calibration, **restrict).estimates
