"""Automatic placement: a planner that chooses which roles share devices and each role's parallel
layout by simulating one PPO step per candidate (HybridFlow section 6, Algorithm 1).
Pure Python: importing or running it starts nothing (no Ray, no torch.distributed)."""
from hybridflow.placement.devices import Cluster, DeviceProfile, device_by_name
from hybridflow.placement.plans import Estimate, Plan, Pool, RoleLayout, enumerate_plans
from hybridflow.placement.workload import ModelShape, Workload, model_by_name

__all__ = ["Cluster", "DeviceProfile", "device_by_name", "Estimate", "Plan", "Pool", "RoleLayout",
           "enumerate_plans", "ModelShape", "Workload", "model_by_name", "plan_all"]


def plan_all(workload, cluster, calibration=None):
    """See ``hybridflow.placement.planner.plan_all`` (imported lazily: the cost model is the heavy part)."""
    from hybridflow.placement.planner import plan_all as _plan_all
    return _plan_all(workload, cluster, calibration)
