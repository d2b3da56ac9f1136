"""The actor objective: the on-policy shortcut equals PPO with recomputed old log-probs, and every
loss setting comes from the actor's config section by name."""
from dataclasses import fields, make_dataclass
from types import SimpleNamespace

import torch

from hybridflow.algorithms.mini_batch_agg import single_batch_meta
from hybridflow.algorithms.objectives import ActorObjective, count_skipped_rows, make_actor_loss_fn, make_critic_loss_fn
from hybridflow.protocol import DataProto


def micro(with_old: bool, log_prob: torch.Tensor):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tensors = {"response_mask": mask, "advantages": torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]]),
               "rollout_log_probs": log_prob.detach() + 0.01}
    if with_old:
        tensors["old_log_probs"] = log_prob.detach()
    return DataProto.from_dict(tensors, meta_info=single_batch_meta(mask))


def test_on_policy_shortcut_matches_explicit_old_log_probs():
    loss_fn = make_actor_loss_fn(ActorObjective(entropy_coeff=0.0))
    grads = []
    for with_old in (True, False):
        lp = torch.log(torch.full((2, 4), 0.3)).requires_grad_()
        loss, metrics = loss_fn({"log_probs": lp}, micro(with_old, lp))
        loss.backward()
        grads.append(lp.grad.clone())
        # token-mean of -ratio*A at ratio 1: -(1+1+1-2-2)/5
        assert abs(float(loss) - 0.2) < 1e-6 and metrics["actor/ppo_kl"] == 0.0
    assert torch.allclose(grads[0], grads[1])
    # only the shortcut measures the sampler-vs-trainer gap itself: |0.3*e^0.01 - 0.3|
    assert abs(metrics["training/rollout_probs_diff_max"] - 0.3 * (torch.e ** 0.01 - 1)) < 1e-6


def test_policy_loss_names_the_surrogate():
    """actor.policy_loss.loss_mode picks the loss: off-policy, GSPO's sequence ratio clips where
    per-token PPO does not (token log-ratios 0.15 and 0.05 on row 0: sequence mean 0.1)."""
    lp = torch.log(torch.full((2, 4), 0.3)).requires_grad_()
    data = micro(True, lp)
    data.batch["old_log_probs"] = lp.detach() - torch.tensor([[0.15, 0.05, 0.1, 0.0], [0.0] * 4])
    losses = {}
    for name in ("vanilla", "gspo"):
        loss, metrics = make_actor_loss_fn(ActorObjective(policy_loss=name, clip_ratio=0.12))({"log_probs": lp}, data)
        losses[name] = (float(loss), metrics["actor/pg_clipfrac"])
    assert abs(losses["vanilla"][1] - 0.2) < 1e-6  # one token of five: exp(0.15) > 1.12
    assert losses["gspo"][1] == 0.0  # the sequence ratio exp(0.1) < 1.12 on all three tokens
    assert losses["vanilla"][0] != losses["gspo"][0]


def test_critic_loss_is_clipped_value_loss():
    loss_fn = make_critic_loss_fn(cliprange_value=0.5)
    b = DataProto.from_dict({"response_mask": torch.ones(1, 2), "values": torch.zeros(1, 2),
                             "returns": torch.tensor([[1.0, 2.0]])}, meta_info=single_batch_meta(torch.ones(1, 2)))
    loss, m = loss_fn({"values": torch.zeros(1, 2)}, b)
    # 0.5 * mean((v - R)^2) = 0.5 * (1 + 4) / 2
    assert abs(float(loss) - 1.25) < 1e-6 and "critic/vf_clipfrac" in m


def test_inert_rows_are_the_rows_without_gradient():
    """The rows the engine may leave out: advantage 0 on every valid token, and only when no
    entropy or KL term needs every row. Their gradient under the real loss is exactly 0."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[0.0, 0.0, 5.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])  # 5.0 sits on padding
    data = DataProto.from_dict({"response_mask": mask, "advantages": adv}, meta_info=single_batch_meta(mask))
    assert ActorObjective().inert_rows(data.batch).tolist() == [True, False, True]
    for off in (ActorObjective(entropy_coeff=0.01), ActorObjective(use_kl_loss=True),
                ActorObjective(skip_zero_advantage=False)):
        assert off.inert_rows(data.batch) is None
    lp = torch.log(torch.full((3, 3), 0.3)).requires_grad_()
    loss, _ = make_actor_loss_fn(ActorObjective())({"log_probs": lp}, data)
    loss.backward()
    assert torch.equal(lp.grad[[0, 2]], torch.zeros(2, 3)) and lp.grad[1].abs().sum() > 0


def test_metrics_count_the_skipped_rows_as_the_zeros_they_are():
    """pg_loss and the clip fractions logged with skip_zero_advantage equal those of the whole
    mini-batch (equal-length rows, so the engine's row-weighted mean is the token mean), on- and
    off-policy; a mini-batch whose rows were all skipped logs 0, not nothing."""
    mask = torch.ones(4, 3)
    adv = torch.tensor([[1.0] * 3, [0.0] * 3, [-2.0] * 3, [0.0] * 3])
    lp = torch.log(torch.tensor([[0.3, 0.4, 0.5]] * 4))
    for on_policy in (True, False):
        data = DataProto.from_dict({"response_mask": mask, "advantages": adv}, meta_info=single_batch_meta(mask))
        if not on_policy:  # ratios off 1 on every row, so the clip fractions are not 0
            data.batch["old_log_probs"] = lp - torch.tensor([0.3, -0.3, 0.05])
        loss_fn = make_actor_loss_fn(ActorObjective(clip_ratio=0.2))
        _, whole = loss_fn({"log_probs": lp}, data)
        kept = data[[0, 2]]
        _, part = loss_fn({"log_probs": lp[[0, 2]]}, kept)
        logged = count_skipped_rows({**part, "skipped_rows_frac": 0.5}, on_policy=on_policy)
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
            assert abs(logged[key] - whole[key]) < 1e-6, (on_policy, key)
        assert on_policy or whole["actor/pg_clipfrac"] > 0
    assert count_skipped_rows({"skipped_rows_frac": 1.0, "grad_norm": 0.0}, on_policy=True)["actor/pg_loss"] == 0.0
    assert count_skipped_rows({"actor/pg_loss": 0.5}, on_policy=True) == {"actor/pg_loss": 0.5}


def test_every_objective_field_is_read_from_the_actor_section_by_its_name():
    """A new loss key is a field on the actor section and here (and the loss that reads it): nothing
    in between copies it. A subclass stands in for the objective with one more field."""
    wider = make_dataclass("WiderObjective", [("new_loss_key", float, 0.0)], bases=(ActorObjective,), frozen=True)
    own = [f.name for f in fields(ActorObjective) if f.name != "policy_loss"]
    section = SimpleNamespace(policy_loss=SimpleNamespace(loss_mode="gspo"), new_loss_key=0.5,
                              **{name: object() for name in own})
    objective = wider.from_section(section)
    assert objective.new_loss_key == 0.5 and objective.policy_loss == "gspo"
    assert all(getattr(objective, name) is getattr(section, name) for name in own)


def test_the_worker_gets_the_objective_of_the_loaded_actor_section():
    from hybridflow.config import derive, load_config
    from recipes.build import actor_settings

    cfg = load_config({"actor_rollout_ref": {"actor": {"clip_ratio_c": 5.0, "entropy_coeff": 0.01, "kl_loss_coef": 0.1,
                                                       "policy_loss": {"loss_mode": "gspo"}}}})
    objective = actor_settings(cfg, derive(cfg), ("actor",)).objective
    assert objective == ActorObjective.from_section(cfg.actor_rollout_ref.actor)
    assert (objective.clip_ratio_c, objective.entropy_coeff, objective.kl_loss_coef, objective.policy_loss) == (
        5.0, 0.01, 0.1, "gspo")
