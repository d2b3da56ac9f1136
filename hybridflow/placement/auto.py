"""``trainer.placement=auto``: plan before Ray starts, say what was chosen and why, run that.

The recipe calls :func:`choose_placement` on the loaded config; it calibrates the machine (CPU,
cached), plans with the runtime's placements only (colocate, separate), keeps the plans the runtime
can run and whose config validates, prints the chosen one and the best alternatives with their
predicted step time and memory per slot on stderr, and returns the Hydra overrides that run it.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from hybridflow.config.errors import ConfigError
from hybridflow.placement.from_config import (LocalPlanError, apply_plan, cluster_from_config, local_slots,
                                              workload_from_config)

GiB = 2 ** 30
RUNTIME_PLACEMENTS = ("colocate", "separate", "rm-pool")


@dataclass
class Candidate:
    estimate: object  # plans.Estimate
    overrides: list[str]


@dataclass
class AutoPlan:
    candidates: list  # runnable here, fastest predicted first
    skipped: dict = field(default_factory=dict)  # reason -> count (infeasible, not built here, invalid config)
    seconds: float = 0.0
    device: str = ""
    planned: int = 0

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]


def device_calibration(cfg, workload, refresh: bool = False, log=None):
    """The planner's ``calibration`` for this machine: measured on CPU (cached), datasheet on GPU."""
    from hybridflow import device

    if device.uses_gpu(cfg.trainer.device):
        from hybridflow.placement.devices import device_by_name

        name = device.device_name().lower() if hasattr(device, "device_name") else ""
        profile = next((n for n in ("h100", "a100") if n in name), None)
        if profile is None:
            raise ConfigError(f"trainer.placement=auto: no device profile for GPU {name!r} (known: h100, a100); "
                              "set trainer.placement=colocate or separate")
        return device_by_name(profile), device_by_name(profile).source
    from hybridflow.placement.calibrate import calibrate

    threads = max(1, int(cfg.trainer.cpus_per_worker))
    cal = calibrate(workload, threads, refresh=refresh, slots=local_slots(cfg), log=log)
    return cal.planner_arg(), cal.device.source + (" (cached)" if cal.cached else "")


def plan_config(cfg, check=None, refresh: bool = False, log=None, keep_combos: int | None = None) -> AutoPlan:
    """Every plan for ``cfg`` on this machine that the runtime can run, fastest predicted first.
    ``check(overrides)`` raises ConfigError when the config with those overrides does not validate.
    ``keep_combos``: layout combinations kept per pool (the planner's pruning; the bench widens it)."""
    from hybridflow.placement.planner import plan

    t0 = time.perf_counter()
    errors = auto_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
    workload = workload_from_config(cfg)
    calibration, source = device_calibration(cfg, workload, refresh, log)
    cluster = cluster_from_config(cfg, calibration["device"] if isinstance(calibration, dict) else calibration)
    result = _plan(plan, workload, cluster, calibration, keep_combos)
    out = AutoPlan([], {}, 0.0, source, len(result.estimates))
    for est in result.estimates:
        if not est.feasible:
            _count(out.skipped, "does not fit: " + est.reason.split(":", 1)[0])
            continue
        try:
            overrides = apply_plan(cfg, est.plan)
            if check is not None:
                check(overrides)
        except LocalPlanError as err:
            _count(out.skipped, f"not built here: {err}")
            continue
        except ConfigError as err:
            _count(out.skipped, f"config does not validate: {str(err)[:120]}")
            continue
        out.candidates.append(Candidate(est, overrides))
    out.seconds = time.perf_counter() - t0
    if not out.candidates:
        raise ConfigError(f"trainer.placement=auto: no plan runs here ({out.skipped}); set trainer.placement="
                          "colocate or separate")
    return out


def _plan(plan, workload, cluster, calibration, keep_combos):
    import inspect

    if keep_combos is None:
        return plan(workload, cluster, calibration, placements=RUNTIME_PLACEMENTS)
    if "keep_combos" in inspect.signature(plan).parameters:
        return plan(workload, cluster, calibration, placements=RUNTIME_PLACEMENTS, keep_combos=keep_combos)
    from hybridflow.placement import space

    saved = space.KEEP_COMBOS
    space.KEEP_COMBOS = keep_combos
    try:
        return plan(workload, cluster, calibration, placements=RUNTIME_PLACEMENTS)
    finally:
        space.KEEP_COMBOS = saved


def _count(d: dict, key: str) -> None:
    d[key] = d.get(key, 0) + 1


def auto_errors(cfg) -> list[str]:
    """What ``trainer.placement=auto`` cannot plan for, each a one-line error with its fix."""
    from hybridflow.config.placement_auto import placement_auto_errors

    return placement_auto_errors(cfg, resolving=True)


def peak_gib(est) -> float:
    return est.peak / GiB


def describe(cand: Candidate) -> str:
    e = cand.estimate
    return f"{e.step_s:.2f} s/step, peak {peak_gib(e):.2f} GiB/slot: {e.plan.describe()}"


def report(auto: AutoPlan, top: int = 4) -> str:
    """The lines printed on stderr: chosen plan, its overrides, the best alternatives, what was skipped."""
    lines = [f"trainer.placement=auto: {auto.planned} plans simulated in {auto.seconds:.1f} s, "
             f"{len(auto.candidates)} runnable here; device: {auto.device}",
             f"  chosen:  {describe(auto.chosen)}",
             f"           runs as: {' '.join(auto.chosen.overrides)}"]
    for i, cand in enumerate(auto.candidates[1:top + 1], 2):
        lines.append(f"  {i}.      {describe(cand)}")
    if auto.skipped:
        lines.append("  skipped: " + "; ".join(f"{n} x {why}" for why, n in sorted(auto.skipped.items())))
    return "\n".join(lines)


def choose_placement(cfg, check=None, stream=None, top: int = 4) -> list[str]:
    """Plan ``cfg`` (placement auto), print the choice and alternatives on ``stream`` (stderr), and
    return the overrides that run the chosen plan (appended after the user's, they win)."""
    stream = stream or sys.stderr
    auto = plan_config(cfg, check, log=lambda m: print(f"calibrating: {m}", file=stream, flush=True))
    print(report(auto, top), file=stream, flush=True)
    return auto.chosen.overrides
