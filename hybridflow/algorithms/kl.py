"""KL between the policy and the reference policy, per token, and the KL coefficient controllers.

Estimators of KL(pi || pi_ref) from one sample x ~ pi, with log-ratio d = log pi(x) - log pi_ref(x)
(Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):
  k1 = d                       unbiased, high variance, can be negative
  abs = |d|                    (not from the blog; verl's "abs")
  k2 = 0.5 d^2                 biased, low variance ("mse")
  k3 = exp(-d) - 1 + d         unbiased, low variance, always >= 0 ("low_var_kl")
Registry: `KL_ESTIMATORS` lists every name (aliases included); `get_kl_estimator(name)` looks one
up. Controllers: `KL_CONTROLLERS` ("fixed", "adaptive"), built by `make_kl_controller`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.masked import masked_mean

KLFn = Callable[[Tensor, Tensor], Tensor]


def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return log_prob - ref_log_prob


def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return (log_prob - ref_log_prob).abs()


def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = r - 1 - log r with r = pi_ref/pi. Differs from the blog by two clamps (as in verl):
    log r to [-20, 20] so exp() stays finite, and the result to [-10, 10] so one token whose
    probability collapsed cannot dominate the penalty."""
    log_r = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "mse": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


def get_kl_estimator(name: str) -> KLFn:
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown kl_penalty / kl_loss_type {name!r}; known: {sorted(KL_ESTIMATORS)}"
        ) from None


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate [B, R] of the named kind (not masked)."""
    return get_kl_estimator(kl_type)(log_prob.float(), ref_log_prob.float())


def kl_loss(log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor, kl_type: str = "low_var_kl",
            loss_agg_mode: str = "token-mean") -> Tensor:
    """KL as an actor loss term (GRPO, Shao et al. 2024, eq. 3-4, uses k3), aggregated like the
    policy loss. Differentiable in `log_prob`."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_type), response_mask, loss_agg_mode)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. 2:
    e_t = clip((KL_t - KL_target) / KL_target, -0.2, 0.2),  beta_{t+1} = beta_t (1 + K_beta e_t),
    with K_beta = n_steps / horizon (n_steps = samples seen since the last update)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise ValueError(
                "algorithm.kl_ctrl for type=adaptive needs kl_coef >= 0, target_kl > 0, horizon > 0; "
                f"got kl_coef={init_kl_coef}, target_kl={target_kl}, horizon={horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


KLController = FixedKLController | AdaptiveKLController

KL_CONTROLLERS: dict[str, type] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
}


def make_kl_controller(ctrl_type: str, kl_coef: float, target_kl: float | None = None,
                       horizon: float | None = None) -> KLController:
    """Build the controller named by `algorithm.kl_ctrl.type` ("fixed" ignores target/horizon)."""
    if ctrl_type not in KL_CONTROLLERS:
        raise ValueError(f"unknown algorithm.kl_ctrl.type {ctrl_type!r}; known: {sorted(KL_CONTROLLERS)}")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if target_kl is None or horizon is None:
        raise ValueError("algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def apply_kl_penalty(token_level_scores: Tensor, old_log_prob: Tensor, ref_log_prob: Tensor,
                     response_mask: Tensor, kl_ctrl: KLController, kl_type: str = "kl"
                     ) -> tuple[Tensor, dict[str, float]]:
    """In-reward KL penalty (Ziegler et al. 2019, eq. 1; Ouyang et al. 2022, eq. 2):
    r_t = score_t - beta * KL_t on valid tokens. Also steps the controller with this batch's KL
    (mean over sequences of the per-sequence token-mean KL) and n_steps = batch size.

    Returns (token_level_rewards [B, R], metrics). The reported coefficient is the one *used*
    for this batch, i.e. before the controller's update.
    """
    mask = response_mask.float()
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_type) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores.float() - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
