"""GSPO's policy-gradient term is aggregated seq-mean-token-mean whatever actor.loss_agg_mode
says (verl's compute_policy_loss_gspo), also when the mini-batch is trained in uneven
micro-batches; the entropy and KL terms keep loss_agg_mode, as in verl's dp_actor."""
import math

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, PolicyLossConfig, agg_loss, gspo_loss
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.mini_batch_agg import (
    META_DP_SIZE, META_GLOBAL_NONEMPTY_ROWS, META_GLOBAL_ROWS, META_GLOBAL_TOKENS, META_MINI_BATCH_ROWS,
)
from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn
from hybridflow.protocol import DataProto

CLIP = 0.1
# four responses of different lengths (one empty), token log-ratios up to +-0.3 so some clip
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
OLD = -torch.linspace(0.5, 2.5, 20).reshape(4, 5)
NEW = OLD + torch.tensor([[0.3, 0.1, -0.2, 0.25, 9.0], [-0.3, 0.05, 0.0, 0.0, 0.0], [0.0] * 5,
                          [0.02, -0.01, 0.03, 0.0, 0.01]])
ADV = torch.tensor([[1.5] * 5, [-0.7] * 5, [0.4] * 5, [-1.0] * 5])


def reference_gspo(old, new, adv, mask, clip):
    """GSPO's loss by hand, row by row: the sequence ratio s_i, clipped, averaged over the
    non-empty sequences (the per-token form has value s_i on every token)."""
    per_seq = []
    for i in range(len(mask)):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not valid:
            continue
        s = math.exp(sum(float(new[i, t] - old[i, t]) for t in valid) / len(valid))
        per_seq.append(sum(max(-float(adv[i, t]) * s, -float(adv[i, t]) * min(max(s, 1 - clip), 1 + clip))
                           for t in valid) / len(valid))
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_gspo_pg_loss_is_seq_mean_token_mean_under_every_mode(mode):
    out = gspo_loss(OLD, NEW, ADV, MASK, PolicyLossConfig(clip_ratio=CLIP, loss_agg_mode=mode))
    assert out.loss_agg_mode == "seq-mean-token-mean"
    assert out.pg_loss.item() == pytest.approx(reference_gspo(OLD, NEW, ADV, MASK, CLIP), rel=1e-5)


def _micro(rows, entropy_rows, meta):
    data = DataProto.from_dict({"response_mask": MASK[rows], "advantages": ADV[rows], "old_log_probs": OLD[rows],
                                "ref_log_prob": OLD[rows] - 0.1}, meta_info=meta)
    log_prob = NEW[rows].clone().requires_grad_()
    return data, {"log_probs": log_prob, "entropy": entropy_rows}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_gspo_objective_over_uneven_micro_batches(mode):
    """Micro-batches of 1 and 3 rows on one rank, each scaled by its share of the rank's rows as
    the engine does: the sum is reference GSPO (seq-mean-token-mean) minus the entropy bonus plus
    the KL loss, those two aggregated with ``mode``."""
    entropy = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    obj = ActorObjective(policy_loss="gspo", clip_ratio=CLIP, entropy_coeff=0.01, use_kl_loss=True,
                         kl_loss_coef=0.2, kl_loss_type="low_var_kl", loss_agg_mode=mode)
    loss_fn = make_actor_loss_fn(obj)
    meta = {META_DP_SIZE: 1, META_MINI_BATCH_ROWS: 4, META_GLOBAL_TOKENS: int(MASK.sum()), META_GLOBAL_ROWS: 4,
            META_GLOBAL_NONEMPTY_ROWS: int((MASK.sum(-1) > 0).sum())}
    total = 0.0
    for rows in ([0], [1, 2, 3]):
        data, outputs = _micro(rows, entropy[rows], meta)
        loss, _ = loss_fn(outputs, data)
        total += float(loss.detach()) * len(rows) / 4
    kl = kl_penalty(NEW, OLD - 0.1, "low_var_kl")
    expected = (reference_gspo(OLD, NEW, ADV, MASK, CLIP) - 0.01 * float(agg_loss(entropy, MASK, mode))
                + 0.2 * float(agg_loss(kl, MASK, mode)))
    assert total == pytest.approx(expected, abs=1e-6)


def test_a_loss_that_names_no_aggregation_follows_loss_agg_mode():
    """A policy loss of a user's own (docs/extending.md) that returns no loss_agg_mode is
    aggregated over the mini-batch with actor.loss_agg_mode, as before GSPO fixed its own."""
    from hybridflow.algorithms import POLICY_LOSSES, PolicyLossOutput, ppo_clip_loss

    def own_loss(old, new, adv, mask, config):
        out = ppo_clip_loss(old, new, adv, mask, config)
        return PolicyLossOutput(out.pg_loss, out.pg_clipfrac, out.ppo_kl, out.pg_clipfrac_lower, out.token_losses)

    POLICY_LOSSES["own_loss"] = own_loss
    try:
        for mode in ("token-mean", "seq-mean-token-sum"):
            rows = [0, 1, 2, 3]
            meta = {META_DP_SIZE: 1, META_MINI_BATCH_ROWS: 4, META_GLOBAL_TOKENS: int(MASK.sum()), META_GLOBAL_ROWS: 4,
                    META_GLOBAL_NONEMPTY_ROWS: 3}
            data, outputs = _micro(rows, None, meta)
            loss, _ = make_actor_loss_fn(ActorObjective(policy_loss="own_loss", clip_ratio=CLIP,
                                                        loss_agg_mode=mode))(outputs, data)
            expected = ppo_clip_loss(OLD, NEW, ADV, MASK, PolicyLossConfig(clip_ratio=CLIP, loss_agg_mode=mode))
            assert float(loss.detach()) == pytest.approx(float(expected.pg_loss), abs=1e-6)
    finally:
        del POLICY_LOSSES["own_loss"]
