"""Pure tensor functions of the RL algorithms: advantage estimators, policy/value losses, KL
estimators and controllers, loss aggregation, diagnostics. No distributed code, no I/O.

Each kind has one registry dict in its own file (read that file to see every name):
  advantages.ADVANTAGE_ESTIMATORS   policy_loss.POLICY_LOSSES   kl.KL_ESTIMATORS
  kl.KL_CONTROLLERS                 loss_agg.LOSS_AGG_MODES   dynamic_sampling.FILTER_METRICS
"""

from hybridflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantage,
    get_advantage_estimator,
)
from hybridflow.algorithms.diagnostics import approx_kl, clipfrac, combine_metric, explained_variance
from hybridflow.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.algorithms.loss_agg import (
    LOSS_AGG_MODES,
    agg_entropy,
    agg_loss,
    entropy_from_logits,
    get_loss_agg,
)
from hybridflow.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossOutput,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
)
from hybridflow.algorithms.value_loss import ValueLossOutput, clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "compute_advantage", "get_advantage_estimator",
    "approx_kl", "clipfrac", "combine_metric", "explained_variance",
    "KL_CONTROLLERS", "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController",
    "apply_kl_penalty", "get_kl_estimator", "kl_loss", "kl_penalty", "make_kl_controller",
    "LOSS_AGG_MODES", "agg_entropy", "agg_loss", "entropy_from_logits", "get_loss_agg",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "POLICY_LOSSES", "PolicyLossConfig", "PolicyLossOutput", "get_policy_loss", "gspo_loss", "ppo_clip_loss",
    "ValueLossOutput", "clipped_value_loss",
]
