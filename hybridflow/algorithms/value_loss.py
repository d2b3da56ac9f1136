"""Critic loss: clipped value regression (PPO).

The value clipping is not in the PPO paper's equations; it comes from the reference
implementation (OpenAI baselines ppo2) and is analysed in Engstrom et al. 2020 ("Implementation
Matters in Deep Policy Gradients", the "value function clipping" optimisation):

    L_V = 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)

where V_old are the values recorded at rollout time and R are the returns (e.g. from GAE).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.masked import masked_mean


class ValueLossOutput(NamedTuple):
    vf_loss: Tensor  # scalar, differentiable
    vf_clipfrac: Tensor  # fraction of valid tokens where the clipped branch was the larger loss
    token_losses: Tensor | None = None  # [B, R], 0.5 * squared error, before aggregation


def clipped_value_loss(vpreds: Tensor, values: Tensor, returns: Tensor, response_mask: Tensor,
                       cliprange_value: float | None = 0.5,
                       loss_agg_mode: str = "token-mean") -> ValueLossOutput:
    """0.5 * agg(max(unclipped, clipped) squared error). `cliprange_value=None` gives the plain
    (unclipped) 0.5 * MSE, with vf_clipfrac 0."""
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        return ValueLossOutput(0.5 * agg_loss(unclipped, response_mask, loss_agg_mode),
                               torch.zeros((), dtype=unclipped.dtype), 0.5 * unclipped)
    if cliprange_value <= 0:
        raise ValueError(f"critic.cliprange_value must be > 0 (got {cliprange_value}); use null to disable clipping")
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    clipped = (vpred_clipped - returns) ** 2
    token_losses = 0.5 * torch.maximum(unclipped, clipped)
    vf_loss = agg_loss(token_losses, response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return ValueLossOutput(vf_loss, vf_clipfrac, token_losses)
