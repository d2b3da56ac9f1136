"""The controller's check that training still computes numbers: a loss or gradient norm that turns
NaN or infinite (a learning rate far too high, damaged weights, a reward of inf) would otherwise
train on, write NaN into every later checkpoint and the final ``hf/`` export, and exit 0."""
from __future__ import annotations

import math


from hybridflow.trainer.checkpoint import newest_verified


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; the run stops before saving that step."""


def watched(key: str) -> bool:
    """The metrics that turn non-finite first when the weights or the update go bad: each role's
    losses (pg_loss, kl_loss, vf_loss; SFT's train/loss) and gradient norms."""
    role, _, name = key.partition("/")
    return role in ("actor", "critic", "train") and (name.endswith("loss") or name == "grad_norm")


def first_non_finite(metrics: dict) -> tuple[str, float] | None:
    """The first watched metric (in sorted order) that is NaN or infinite, or None."""
    for key in sorted(metrics):
        if watched(key):
            value = float(metrics[key])
            if not math.isfinite(value):
                return key, value
    return None


# the key a user lowers when training diverges; SFT's config has its optimizer at the top level
PPO_LR_KEY = "actor_rollout_ref.actor.optim.lr"


def non_finite_message(step: int, key: str, value: float, newest_good: str | None,
                       lr_key: str = PPO_LR_KEY) -> str:
    where = (f"the newest checkpoint that verifies is {newest_good}" if newest_good
             else "no checkpoint was saved before it")
    return (f"step {step}: {key} is {value} (training diverged or the weights are damaged); the run stopped "
            f"without saving this step, and {where}: resume from it with a lower learning rate "
            f"({lr_key}) or check the data and the reward function")


def stop_if_non_finite(metrics: dict, step: int, root: str, lr_key: str = PPO_LR_KEY) -> None:
    """Raise NonFiniteError when a watched metric of ``step`` is NaN/inf; called after the step's
    record is logged (it shows what went wrong, and a resume drops it) and before it is saved."""
    bad = first_non_finite(metrics)
    if bad is not None:
        raise NonFiniteError(non_finite_message(step, *bad, newest_verified(root), lr_key=lr_key))
