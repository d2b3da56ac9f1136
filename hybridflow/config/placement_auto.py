"""``trainer.placement=auto``: what the planner (hybridflow/placement/auto.py) can plan for.

The recipe replaces ``auto`` by the chosen plan's keys before validation, so a config that reaches
``validate`` still saying ``auto`` was never planned (a caller that skipped the recipe's step)."""
from __future__ import annotations

from hybridflow.config.keys import ARR


def placement_auto_errors(cfg, resolving: bool = False) -> list[str]:
    """One line per problem. ``resolving``: called by the planner itself (auto is expected there)."""
    t = cfg.trainer
    if t.placement != "auto":
        return []
    if not resolving:
        return ["trainer.placement=auto is decided by the recipe before validation (recipes/main_ppo.py calls "
                "hybridflow.placement.auto.choose_placement): run the recipe, or set trainer.placement=colocate "
                "or separate"]
    errors = []
    if cfg.ray_init.address:
        errors.append(f"trainer.placement=auto plans for this machine's slots, but ray_init.address="
                      f"{cfg.ray_init.address} joins a cluster whose slots are not known here: set "
                      "trainer.placement=colocate or separate")
    if not cfg.actor_rollout_ref.hybrid_engine:
        errors.append(f"trainer.placement=auto plans the hybrid engine's placements; {ARR}.hybrid_engine=false "
                      "(a rollout pool of its own) is placed by hand: set trainer.placement=colocate")
    return errors
