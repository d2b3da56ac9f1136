"""``algorithm``: advantage estimator and KL-in-reward settings (verl's key names).

Names are checked against the registries in ``hybridflow.algorithms`` by ``validate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KLCtrlConfig:
    """KL coefficient of the reward penalty. ``adaptive`` is Ziegler et al. (2019) eq. 2 and needs
    ``target_kl`` and ``horizon``."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (hybridflow/algorithms/dynamic_sampling.py): drop prompts whose
    samples' ``metric`` (seq_reward | score | acc) are all equal and generate more until
    ``data.train_batch_size`` prompts remain; ``max_num_gen_batches`` caps the generation
    batches per step (0: no cap)."""

    enable: bool = False
    metric: str = "seq_reward"
    max_num_gen_batches: int = 0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # verl's default; recipes pick theirs
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # the KL estimator of the reward penalty
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
