"""Policy-gradient losses: (old_log_prob, log_prob, advantages) [B, R] -> scalar loss + stats.

Every loss has the same signature

    fn(old_log_prob, log_prob, advantages, response_mask, config: PolicyLossConfig) -> PolicyLossOutput

Registry: `POLICY_LOSSES` at the bottom of this file; `get_policy_loss(name)` looks one up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.masked import masked_mean

# exp() of a log-ratio beyond this overflows float32 gradients; a ratio of e^20 is already
# clipped by any sane clip range, so clamping it changes no loss value that PPO would use.
_LOG_RATIO_LIMIT = 20.0
# GSPO's objective is a mean over sequences of per-sequence token means; only the entropy and KL
# terms follow actor.loss_agg_mode (verl's compute_policy_loss_gspo and dp_actor do the same)
GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"


@dataclass(frozen=True)
class PolicyLossConfig:
    """Clip settings (verl's actor keys). `clip_ratio_low`/`clip_ratio_high` default to
    `clip_ratio` (asymmetric "clip-higher": DAPO, Yu et al. 2025). `clip_ratio_c` is the dual-clip
    bound for negative advantages (Ye et al. 2020); None disables dual-clip."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        low, high = self.low, self.high
        if not (0.0 <= low < 1.0) or high < 0.0:
            raise ValueError(
                f"actor clip range must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                f"got low={low}, high={high}"
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"actor.clip_ratio_c must be > 1.0 for dual-clip (got {self.clip_ratio_c}); "
                "set it to e.g. 3.0, or null to disable dual-clip"
            )

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class PolicyLossOutput(NamedTuple):
    pg_loss: Tensor  # scalar, differentiable
    pg_clipfrac: Tensor  # fraction of valid tokens where the upper/lower PPO clip was active
    ppo_kl: Tensor  # masked mean of (old_log_prob - log_prob): k1 estimate of KL(old || new)
    pg_clipfrac_lower: Tensor  # fraction of valid tokens where the dual-clip bound was active
    token_losses: Tensor | None = None  # [B, R] before aggregation (for a mini-batch-wide aggregate)
    # the aggregation pg_loss used when a loss fixes its own (gspo); None: config.loss_agg_mode.
    # A mini-batch-wide aggregate of token_losses must use the same.
    loss_agg_mode: str | None = None


def ppo_clip_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                  config: PolicyLossConfig = PolicyLossConfig()) -> PolicyLossOutput:
    """PPO clipped surrogate, Schulman et al. 2017, eq. 7, as a loss to minimise:
    L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi/pi_old.
    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", dual-clip PPO:
    max(min(r A, clip(r) A), c A) for A < 0): for A_t < 0
    the loss is further bounded by -A_t * c, so a huge ratio on a bad action cannot blow up.

    Differences: the asymmetric range (eps_low != eps_high) follows DAPO's clip-higher; the
    log-ratio is clamped to +-20 before exp() to keep float32 finite.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.low, 1.0 + config.high)
    ppo_losses = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)

    if config.clip_ratio_c is None:
        losses = ppo_losses
        pg_clipfrac_lower = torch.zeros((), dtype=ppo_losses.dtype)
    else:
        dual_bound = -advantages * config.clip_ratio_c
        negative = advantages < 0
        losses = torch.where(negative, torch.minimum(ppo_losses, dual_bound), ppo_losses)
        pg_clipfrac_lower = masked_mean(((ppo_losses > dual_bound) & negative).float(), response_mask)

    pg_loss = agg_loss(losses, response_mask, config.loss_agg_mode)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower, losses)


def gspo_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
              config: PolicyLossConfig = PolicyLossConfig()) -> PolicyLossOutput:
    """GSPO, Zheng et al. 2025 ("Group Sequence Policy Optimization"): the importance ratio is
    the sequence's length-normalised likelihood ratio (eq. 7),
        s_i = exp(1/|y_i| sum_t log(pi(y_it) / pi_old(y_it))),
    clipped per sequence instead of per token. This is the GSPO-token form (eq. 13),
        s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)],
    whose value is s_i on every token and whose gradient is GSPO's when A_it = A_i (outcome
    rewards), and which also takes per-token advantages. Loss: max(-A s_it, -A clip(s_it)),
    averaged over each sequence's tokens, then over sequences (the GSPO-token objective's
    1/G sum_i 1/|y_i| sum_t): seq-mean-token-mean whatever ``loss_agg_mode`` says, as verl's
    compute_policy_loss_gspo does, so a verl GSPO script trains the same here.

    Differences: no dual-clip (the paper has none; ``clip_ratio_c`` is ignored); the paper's
    clip range is ~1e-3 (e.g. clip_ratio_low 3e-4, clip_ratio_high 4e-4), set it in the config
    (recipes/config/gspo.yaml does).
    """
    mask = response_mask.to(log_prob.dtype)
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = (token_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_s = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(log_s.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.low, 1.0 + config.high)
    losses = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    ppo_kl = masked_mean(-token_log_ratio, response_mask)
    pg_loss = agg_loss(losses, response_mask, GSPO_LOSS_AGG_MODE)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), dtype=losses.dtype), losses,
                            GSPO_LOSS_AGG_MODE)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig], PolicyLossOutput]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    # verl's name (its default); "ppo_clip" is the same loss under the paper's name
    "ppo_clip": ppo_clip_loss,
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss called `name`; ValueError listing the known names otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown actor.policy_loss.loss_mode {name!r}; known: {sorted(POLICY_LOSSES)}"
        ) from None
