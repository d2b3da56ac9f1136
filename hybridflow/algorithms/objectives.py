"""The objectives the training engines minimise (actor and critic).

Each builder returns a ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` as the engine protocol
expects (workers/engines/base.py). The actor objective is PPO's clipped surrogate (Schulman et al.
2017, eq. 7) minus an entropy bonus (eq. 9's c2 term) plus, for GRPO, a KL-to-reference term in the
loss (Shao et al. 2024, eq. 3) instead of in the reward.

Every term is aggregated over the whole mini-batch (``loss_agg_mode`` on all micro-batches and
ranks together, mini_batch_agg.py), not averaged per micro-batch: the step does not depend on
``ppo_micro_batch_size_per_gpu`` or the data-parallel size. The metrics are per micro-batch
values, averaged by the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.loss_agg import agg_entropy, agg_loss
from hybridflow.algorithms.mini_batch_agg import mini_batch_agg
from hybridflow.algorithms.policy_loss import PolicyLossConfig, get_policy_loss
from hybridflow.algorithms.value_loss import clipped_value_loss


def _f(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


@dataclass(frozen=True)
class ActorObjective:
    policy_loss: str = "vanilla"  # a name in POLICY_LOSSES (actor.policy_loss.loss_mode)
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    skip_zero_advantage: bool = True

    @classmethod
    def from_section(cls, actor) -> "ActorObjective":
        """The objective of an actor config section (``actor_rollout_ref.actor``, or any object with
        these attributes): every field is read by its own name, so a new loss key is a field here and
        on the section, and nothing copies it in between. ``policy_loss`` is verl's section:
        its ``loss_mode``."""
        values = {f.name: getattr(actor, f.name) for f in fields(cls)}
        return cls(**{**values, "policy_loss": actor.policy_loss.loss_mode})

    @property
    def needs_entropy(self) -> bool:
        return True  # cheap next to the forward pass, and actor/entropy is a standard diagnostic

    def inert_rows(self, batch) -> torch.Tensor | None:
        """Rows whose loss and gradient are identically zero, which the engine may leave out:
        with no entropy bonus and no KL loss, a row whose advantage is 0 on every response token
        (a GRPO group where every sample scored the same) contributes -0 * ratio everywhere. None
        when the objective has a term that every row feeds."""
        if not self.skip_zero_advantage or self.entropy_coeff or self.use_kl_loss:
            return None
        adv = batch["advantages"] * batch["response_mask"].to(batch["advantages"].dtype)
        return (adv == 0).all(dim=-1)


# Metrics that are exactly 0 on a row the engine skipped (advantage 0 on every token): its
# policy-gradient loss, and both clip fractions (the clipped and unclipped losses are both 0).
ZERO_ON_INERT_ROWS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")


def count_skipped_rows(metrics: dict[str, float], on_policy: bool) -> dict[str, float]:
    """One train_batch's metrics over the whole mini-batch, the rows it skipped included.

    The engine averages metrics over the rows it ran (row-weighted); a skipped row enters here as
    the 0 it is, so the logged curves do not depend on ``skip_zero_advantage`` (and a mini-batch
    whose rows were all skipped logs pg_loss 0). ``actor/ppo_kl`` is 0 on such a row only when the
    update is on-policy (ratio 1). ``actor/entropy`` and the rollout-vs-trainer differences stay
    over the rows run: a skipped row has no forward pass to read them from."""
    frac = metrics.get("skipped_rows_frac")
    if not frac:
        return metrics
    keys = ZERO_ON_INERT_ROWS + (("actor/ppo_kl",) if on_policy else ())
    return {**metrics, **{k: metrics.get(k, 0.0) * (1.0 - frac) for k in keys}}


def make_actor_loss_fn(obj: ActorObjective):
    policy_cfg = PolicyLossConfig(clip_ratio=obj.clip_ratio, clip_ratio_low=obj.clip_ratio_low,
                                  clip_ratio_high=obj.clip_ratio_high, clip_ratio_c=obj.clip_ratio_c,
                                  loss_agg_mode=obj.loss_agg_mode)
    policy_loss = get_policy_loss(obj.policy_loss)

    def loss_fn(outputs: dict, micro) -> tuple[torch.Tensor, dict[str, float]]:
        b = micro.batch
        mask = b["response_mask"].to(outputs["log_probs"].dtype)
        log_prob = outputs["log_probs"]
        on_policy = "old_log_probs" not in b.keys()
        # No old log-probs: the update is strictly on-policy and this forward is the old policy.
        old_log_prob = log_prob.detach() if on_policy else b["old_log_probs"]
        pg = policy_loss(old_log_prob, log_prob, b["advantages"], mask, policy_cfg)
        rows, meta, mode = len(micro), micro.meta_info, obj.loss_agg_mode
        token_losses, pg_loss = pg.token_losses, pg.pg_loss
        if "rollout_is_weights" in b.keys():
            # verl's rollout correction (rollout_correction.py): each token's loss times its detached
            # truncated weight pi_old / pi_rollout, before the aggregation, as verl's policy losses do
            token_losses = token_losses * b["rollout_is_weights"].to(token_losses.dtype)
            pg_loss = agg_loss(token_losses, mask, pg.loss_agg_mode or mode)
        loss = mini_batch_agg(token_losses, mask, pg.loss_agg_mode or mode, meta, rows)  # gspo fixes its own
        metrics = {"actor/pg_loss": _f(pg_loss), "actor/pg_clipfrac": _f(pg.pg_clipfrac),
                   "actor/ppo_kl": _f(pg.ppo_kl), "actor/pg_clipfrac_lower": _f(pg.pg_clipfrac_lower)}
        if on_policy and "rollout_log_probs" in b.keys():
            # the sampler-vs-trainer check, on this forward (the engines keep the max over micro-batches)
            diff = (b["rollout_log_probs"].exp() - log_prob.detach().exp()).abs()[mask.bool()]
            if diff.numel():
                metrics["training/rollout_probs_diff_max"] = float(diff.max())
                metrics["training/rollout_probs_diff_mean"] = float(diff.mean())
        if outputs.get("entropy") is not None:
            metrics["actor/entropy"] = _f(agg_entropy(outputs["entropy"], mask, mode))
            if obj.entropy_coeff:
                loss = loss - obj.entropy_coeff * mini_batch_agg(outputs["entropy"], mask, mode, meta, rows)
        if obj.use_kl_loss:
            kl = kl_penalty(log_prob, b["ref_log_prob"], obj.kl_loss_type)
            loss = loss + obj.kl_loss_coef * mini_batch_agg(kl, mask, mode, meta, rows)
            metrics["actor/kl_loss"] = _f(agg_loss(kl, mask, mode))
            metrics["actor/kl_coef"] = obj.kl_loss_coef
        return loss, metrics

    return loss_fn


def make_critic_loss_fn(cliprange_value: float | None = 0.5, loss_agg_mode: str = "token-mean"):
    def loss_fn(outputs: dict, micro) -> tuple[torch.Tensor, dict[str, float]]:
        b = micro.batch
        mask = b["response_mask"].to(outputs["values"].dtype)
        out = clipped_value_loss(outputs["values"], b["values"], b["returns"], mask, cliprange_value, loss_agg_mode)
        loss = mini_batch_agg(out.token_losses, mask, loss_agg_mode, micro.meta_info, len(micro))
        return loss, {"critic/vf_loss": _f(out.vf_loss), "critic/vf_clipfrac": _f(out.vf_clipfrac)}

    return loss_fn
