"""The controller's side of verl's rollout correction (hybridflow/algorithms/rollout_correction.py).

After the trainer's old log-probs are on the batch and before the advantages (verl's order), the
batch gets ``rollout_is_weights`` (when ``rollout_is`` is set), which travel with it to the actor
workers, where the policy loss multiplies each token's loss by them (algorithms/objectives.py),
and its ``response_mask`` loses the rejected tokens (when ``rollout_rs`` is set), so the
advantages, the loss and the data metrics leave them out.

Strictly on-policy updates skip the old-log-prob forward (``recompute_old_log_prob=auto`` resolves
to skip); with a correction on, auto resolves to always instead (config/resolve.py) and an explicit
skip is refused before any worker starts, since the weights are pi_old / pi_rollout. verl's
``bypass_mode`` (rollout log-probs as pi_old, the ratio pi_theta / pi_rollout) is not offered.
"""
from __future__ import annotations

from hybridflow.algorithms.rollout_correction import rollout_correction
from hybridflow.protocol import DataProto


def apply_rollout_correction(batch: DataProto, rc) -> dict[str, float]:
    """Put the weights on ``batch`` and apply the rejection to its response mask, in place; returns
    the ``rollout_corr/*`` metrics. ``rc``: ``algorithm.rollout_correction``."""
    b = batch.batch
    for needed in ("old_log_probs", "rollout_log_probs"):
        if needed not in b.keys():  # the config check makes this unreachable from the recipes
            raise RuntimeError(f"algorithm.rollout_correction needs '{needed}' on the batch; it has {sorted(b.keys())}")
    out = rollout_correction(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"],
                             rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
                             rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
                             rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
    b["response_mask"] = out.response_mask
    if out.weights is not None:
        b["rollout_is_weights"] = out.weights.to(b["old_log_probs"].dtype)
    return out.metrics
