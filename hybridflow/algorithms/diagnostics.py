"""Metrics that say whether an update was healthy. Read-only: no gradients flow through these."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_mean, masked_var


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens: 1 = the critic predicts the
    returns perfectly, 0 = no better than a constant, < 0 = worse. nan when the returns are constant
    (the ratio is undefined), rather than an arbitrary number. "Constant" includes spreads at
    rounding level, below a standard deviation of 1e-6 or 1e-5 of the returns' own size: a PPO
    run whose rewards were all 0 logged -1e14 here before."""
    var_returns = masked_var(returns.float(), response_mask)
    var_residual = masked_var((returns - values).float(), response_mask)
    scale = masked_mean(returns.float().square(), response_mask)
    if var_returns <= max(1e-10 * scale, 1e-12):
        return torch.tensor(float("nan"))
    return 1.0 - var_residual / var_returns


@torch.no_grad()
def approx_kl(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """KL(old || new) over valid tokens with two of Schulman's estimators (see kl.py):
    "k1" = mean(old - new) (what PPO implementations log as approx_kl) and
    "k3" = mean(exp(new - old) - 1 - (new - old)) (non-negative, lower variance)."""
    log_ratio = (log_prob - old_log_prob).float()
    k1 = masked_mean(-log_ratio, response_mask)
    k3 = masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask)
    return {"k1": k1, "k3": k3}


@torch.no_grad()
def clipfrac(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor,
             clip_low: float, clip_high: float) -> Tensor:
    """Fraction of valid tokens whose ratio pi/pi_old lies outside [1 - clip_low, 1 + clip_high],
    regardless of the advantage's sign (the policy loss's own `pg_clipfrac` counts only the tokens
    where the clip changed the loss)."""
    ratio = torch.exp((log_prob - old_log_prob).float())
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return masked_mean(outside.float(), response_mask)


def combine_metric(key: str, values: list[float], weights: list[float], total_weight: float | None = None) -> float:
    """One number for a metric reported per micro-batch, per rank or per mini-batch: a name ending
    in ``_max`` (``training/rollout_probs_diff_max``) is the maximum, since an average of maxima
    hides the worst token; every other metric is the weighted mean over ``total_weight`` (default:
    the weights' sum; larger when parts without the metric count as 0)."""
    if key.endswith("_max"):
        return max(values)
    total = sum(weights) if total_weight is None else total_weight
    return sum(v * w for v, w in zip(values, weights)) / total
