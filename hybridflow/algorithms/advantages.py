"""Advantage estimators: token-level rewards [B, R] -> (advantages [B, R], returns [B, R]).

Every estimator has the same keyword signature, so the trainer calls any of them by name:

    fn(token_level_rewards, response_mask, *, index=None, values=None, reward_baselines=None,
       gamma=1.0, lam=1.0, norm_adv_by_std=True, epsilon=1e-6) -> (advantages, returns)

and ignores the inputs it does not use. `index` is the group id of each row (numpy array of
uids, rows of one prompt share a uid); `values` [B, R] are critic values; `reward_baselines` [B]
are the greedy responses' scores for ReMax. Outputs are 0 on padding (response_mask == 0).

Registry: `ADVANTAGE_ESTIMATORS` at the bottom of this file lists every estimator with what it
needs (a critic, groups, a greedy baseline); `get_advantage_estimator(name)` looks one up and
`compute_advantage(name, ...)` checks the inputs and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_sum, masked_whiten

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


def _require(value: Any, what: str, estimator: str, fix: str) -> Any:
    if value is None:
        raise ValueError(f"adv_estimator={estimator!r} needs {what}; {fix}")
    return value


def _group_ids(index: Sequence[Any] | np.ndarray, batch: int, estimator: str) -> tuple[Tensor, int]:
    """Map each row's uid to a dense group number 0..G-1 (any hashable uid: str, int, ...)."""
    if len(index) != batch:
        raise ValueError(
            f"adv_estimator={estimator!r}: index has {len(index)} uids for {batch} rows; "
            "give one uid per row (rows sampled from the same prompt share it)"
        )
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in np.asarray(index, dtype=object).tolist()]
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _outcome_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """One scalar per sequence: the sum of its token rewards over valid tokens."""
    return masked_sum(token_level_rewards.float(), response_mask, dim=-1)


def _group_mean_std(scores: Tensor, group: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (group mean, unbiased group std, group size). Two passes for numerical safety."""
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, scores) / count
    dev2 = (scores - mean[group]) ** 2
    var = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, dev2) / (count - 1).clamp(min=1)
    return mean[group], var.sqrt()[group], count[group]


def gae(token_level_rewards: Tensor, response_mask: Tensor, *, values: Tensor | None = None,
        gamma: float = 1.0, lam: float = 1.0, **_: Any) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation, Schulman et al. 2016, eq. 11-16:
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),  A_t = sum_l (gamma lam)^l delta_{t+l}.
    returns = A + V (the critic's regression target), then A is whitened over valid tokens.

    Differs from the textbook in how it walks the mask: a masked token (padding, or a hole such
    as a tool observation) is skipped, so the "next" state of token t is the next *valid* token;
    after the last valid token the episode ends (V = 0). Rewards and values on masked positions
    are ignored.
    """
    values = _require(values, "critic values", "gae", "enable the critic (critic.enable=true)")
    mask = response_mask.bool()
    rewards, values = token_level_rewards.float(), values.float()
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(batch, dtype=rewards.dtype)
    next_adv = torch.zeros(batch, dtype=rewards.dtype)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        valid = mask[:, t]
        advantages[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return masked_whiten(advantages, response_mask), returns


def grpo(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any = None,
         norm_adv_by_std: bool = True, epsilon: float = 1e-6, **_: Any) -> tuple[Tensor, Tensor]:
    """GRPO outcome supervision, Shao et al. 2024 (DeepSeekMath) sec. 4.1.2:
    A_i = (r_i - mean(r_group)) / std(r_group), the same value on every token of response i.
    With norm_adv_by_std=False the division is dropped (Dr. GRPO, Liu et al. 2025,
    "Understanding R1-Zero-Like Training", which removes the std's question-difficulty bias).

    Differences: std is the unbiased one (as torch.std) plus `epsilon`; a group of one response
    has no baseline, so its advantage is its raw score (as in verl) - use rollout.n >= 2.
    returns == advantages (there is no critic).
    """
    index = _require(index, "a group uid per row (index)", "grpo", "sample each prompt rollout.n >= 2 times with a shared uid")
    scores = _outcome_scores(token_level_rewards, response_mask)
    group, n_groups = _group_ids(index, scores.shape[0], "grpo")
    mean, std, count = _group_mean_std(scores, group, n_groups)
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
    adv = adv.unsqueeze(-1) * response_mask.float()
    return adv, adv


def rloo(token_level_rewards: Tensor, response_mask: Tensor, *, index: Any = None,
         **_: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out, Ahmadian et al. 2024 ("Back to Basics", sec. on RLOO; Kool et al. 2019):
    A_i = r_i - 1/(k-1) sum_{j != i} r_j over the k responses of the same prompt.
    A group of one has no other sample: its advantage is its raw score (as in verl).
    """
    index = _require(index, "a group uid per row (index)", "rloo", "sample each prompt rollout.n >= 2 times with a shared uid")
    scores = _outcome_scores(token_level_rewards, response_mask)
    group, n_groups = _group_ids(index, scores.shape[0], "rloo")
    mean, _, count = _group_mean_std(scores, group, n_groups)
    loo_mean = (mean * count - scores) / (count - 1).clamp(min=1)
    baseline = torch.where(count < 2, torch.zeros_like(loo_mean), loo_mean)
    adv = (scores - baseline).unsqueeze(-1) * response_mask.float()
    return adv, adv


def remax(token_level_rewards: Tensor, response_mask: Tensor, *, reward_baselines: Tensor | None = None,
          **_: Any) -> tuple[Tensor, Tensor]:
    """ReMax, Li et al. 2023, Algorithm 1 (the greedy-baseline gradient estimator): A_t = G_t - r(x, y_greedy), with
    G_t = sum_{k >= t} r_k the undiscounted return-to-go and the greedy response's reward as the
    baseline. returns = G (token-level, so a per-token KL penalty is credited correctly).
    """
    reward_baselines = _require(reward_baselines, "the greedy responses' scores (reward_baselines [B])",
                                "remax", "generate one greedy response per prompt and score it")
    mask = response_mask.float()
    returns = (token_level_rewards.float() * mask).flip(-1).cumsum(-1).flip(-1) * mask
    adv = returns - reward_baselines.float().reshape(-1, 1) * mask
    return adv, returns


def reinforce_plus_plus(token_level_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0,
                        **_: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE++, Hu 2025 (token-level KL-shaped reward, global advantage normalisation): G_t = sum_{k >= t} gamma^(k-t) r_k (token-level, KL
    penalty included in r), A = whiten(G) over all valid tokens of the global batch.
    Masked tokens are skipped when discounting (as in `gae`)."""
    mask = response_mask.bool()
    rewards = token_level_rewards.float()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return masked_whiten(returns, response_mask), returns


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registry entry: the function plus what the trainer must provide for it."""

    name: str
    fn: AdvantageFn
    needs_critic: bool = False  # values from a critic (trainer must run critic workers)
    needs_groups: bool = False  # several responses per prompt sharing a uid (rollout.n >= 2)
    needs_greedy_baseline: bool = False  # reward of a greedy response per prompt (ReMax)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator("gae", gae, needs_critic=True),
    "grpo": AdvantageEstimator("grpo", grpo, needs_groups=True),
    "rloo": AdvantageEstimator("rloo", rloo, needs_groups=True),
    "remax": AdvantageEstimator("remax", remax, needs_greedy_baseline=True),
    "reinforce_plus_plus": AdvantageEstimator("reinforce_plus_plus", reinforce_plus_plus),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registry entry called `name`; ValueError listing the known names otherwise."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm.adv_estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


def compute_advantage(name: str, token_level_rewards: Tensor, response_mask: Tensor, *,
                      index: Any = None, values: Tensor | None = None,
                      reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                      norm_adv_by_std: bool = True, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Run the estimator called `name` on one batch; returns (advantages, returns), [B, R] each."""
    estimator = get_advantage_estimator(name)
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, R]"
        )
    if values is not None and values.shape != response_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} must match response_mask {tuple(response_mask.shape)}")
    return estimator.fn(token_level_rewards, response_mask, index=index, values=values,
                        reward_baselines=reward_baselines, gamma=gamma, lam=lam,
                        norm_adv_by_std=norm_adv_by_std, epsilon=epsilon)
