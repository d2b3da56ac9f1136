"""``algorithm``: advantage estimator and KL-in-reward settings (verl's key names)."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import GREATER_THAN_0, NON_NEGATIVE, UNIT, Registry, key


@dataclass
class KLCtrlConfig:
    type: str = key("fixed", "fixed | adaptive (Ziegler et al. 2019 eq. 2)", choices=Registry("KL_CONTROLLERS"))
    kl_coef: float = key(0.001, "the KL coefficient of the reward penalty", NON_NEGATIVE)
    target_kl: float = key(0.1, "adaptive only: the KL the coefficient steers to (> 0)")
    horizon: int = key(10000, "adaptive only: the controller's horizon in samples (a positive integer)")


@dataclass
class FilterGroupsConfig:
    enable: bool = key(False, "drop prompts whose samples' metric are all equal, generate more until "
                              "data.train_batch_size prompts remain")
    metric: str = key("seq_reward", "seq_reward | score | acc (the reward function's acc field)",
                      choices=Registry("FILTER_METRICS", "hybridflow.algorithms.dynamic_sampling"))
    max_num_gen_batches: int = key(0, "generation batches per step at most; 0: no cap", NON_NEGATIVE)


@dataclass
class RolloutCorrectionConfig:
    """verl's rollout correction (hybridflow/algorithms/rollout_correction.py): weights and rejection
    between the rollout's log-probs and the trainer's old log-probs. Off by default (both null)."""
    rollout_is: str | None = key(None, "null | token | sequence: truncated importance weights "
                                       "min(pi_old/pi_rollout, rollout_is_threshold) on the policy loss",
                                 choices=("token", "sequence"))
    rollout_is_threshold: float = key(2.0, "the weights' upper bound (TIS's C)", GREATER_THAN_0)
    rollout_is_batch_normalize: bool = key(False, "divide the weights by their batch mean (of tokens for "
                                                  "token, of sequences for sequence)")
    rollout_rs: str | None = key(None, "null, or comma-separated rejection options {token,seq_sum,seq_mean}_k1, "
                                       "{token,seq_sum,seq_mean,seq_max}_{k2,k3}: rejected tokens/rows leave "
                                       "the response mask (seq_mean_k1: the geometric-mean ratio)")
    rollout_rs_threshold: float | str | None = key(None, "rollout_rs's bounds, one shared or one per option "
                                                         "(comma-separated): k1 a ratio range lower_upper, or U "
                                                         "for 1/U_U; k2/k3 an upper bound")
    bypass_mode: bool = key(False, "pi_old is the rollout's own log-probs: no old-log-prob forward, the PPO ratio is "
                                   "pi_theta/pi_rollout (verl's bypass with loss_type=ppo_clip)")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = key("gae", "gae | grpo | remax | rloo | reinforce_plus_plus",
                             choices=Registry("ADVANTAGE_ESTIMATORS", extensible=True))
    gamma: float = key(1.0, "discount factor", UNIT)
    lam: float = key(1.0, "GAE's lambda", UNIT)
    norm_adv_by_std_in_grpo: bool = key(True, "grpo: divide advantages by the group's std")
    use_kl_in_reward: bool = key(False, "subtract the KL to the reference from the reward")
    kl_penalty: str = key("kl", "the estimator of the reward's KL penalty", choices=Registry("KL_ESTIMATORS"))
    kl_ctrl: KLCtrlConfig = key(KLCtrlConfig(), "the reward penalty's KL coefficient")
    filter_groups: FilterGroupsConfig = key(FilterGroupsConfig(), "DAPO's dynamic sampling "
                                                                  "(hybridflow/algorithms/dynamic_sampling.py)")
    rollout_correction: RolloutCorrectionConfig = key(RolloutCorrectionConfig(), "off-policy correction of the "
                                                      "sampler-vs-trainer mismatch (verl's rollout_correction)")
