"""PPOTrainer.step with algorithm.rollout_correction (trainer/rollout_correction.py), stand-in
worker groups: the weights and the rejected response mask reach the actor's update, and the
rollout_corr/* metrics the step's metrics."""
from __future__ import annotations

import math

import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from tests.hybridflow.trainer.test_dynamic_sampling import PROMPT, RESPONSE
from tests.hybridflow.trainer.test_step import Actor

L2 = math.log(2.0)


class SamplingActor(Actor):
    """The rollout's log-probs are 0; the trainer's are ln 2 on the first response token (rho 2)."""

    def __init__(self, log):
        super().__init__(log)
        self.updated = []

    def generate_sequences(self, gen_in):
        out = super().generate_sequences(gen_in)
        out.batch["rollout_log_probs"] = torch.zeros(len(out), RESPONSE)
        return out

    def compute_log_prob(self, batch, logged=True):
        self.log.append("compute_log_prob")
        old = torch.zeros(len(batch), RESPONSE)
        old[:, 0] = L2
        return DataProto.from_dict({"old_log_probs": old})

    def update_actor(self, batch, logged=True):
        self.updated.append(batch)
        return super().update_actor(batch, logged)


def _step(tmp_path, *overrides):
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.cli import compose_config

    cfg = load_config(compose_config("grpo", [
        f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.balance_batch=false", *overrides]))
    rows = [{"input_ids": torch.full((PROMPT,), i), "attention_mask": torch.ones(PROMPT, dtype=torch.long),
             "position_ids": torch.arange(PROMPT), "data_source": "x", "ground_truth": "y"} for i in range(4)]
    actor = SamplingActor([])
    trainer = PPOTrainer(cfg, {"actor_rollout_ref": actor}, None, ResumablePromptLoader(rows, 4, shuffle=False),
                         None, None, None, progress=False)

    def score(batch):
        token = torch.zeros(len(batch), RESPONSE)
        token[::2, -1] = 1.0
        return token, token.sum(-1).tolist(), {}, {}, None

    trainer.score = score
    trainer.global_step = 1
    metrics = trainer.step(DataProto.from_single_dict(trainer.train_loader.next_batch()))
    return cfg, actor, metrics


def test_token_weights_and_rejection_reach_the_update(tmp_path):
    cfg, actor, metrics = _step(tmp_path, "algorithm.rollout_correction.rollout_is=token",
                                "algorithm.rollout_correction.rollout_is_threshold=1.5",
                                "algorithm.rollout_correction.rollout_rs=token_k1",
                                "algorithm.rollout_correction.rollout_rs_threshold=1.8")
    # on-policy shape, but the correction needs pi_old: auto resolved to always and the forward ran
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == "always"
    assert "compute_log_prob" in actor.log
    (batch,) = actor.updated
    expected_w = torch.ones(8, RESPONSE)
    expected_w[:, 0] = 1.5  # rho 2 truncated at 1.5
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected_w)
    expected_mask = torch.ones(8, RESPONSE, dtype=batch.batch["response_mask"].dtype)
    expected_mask[:, 0] = 0  # rho 2 is outside [1/1.8, 1.8]
    torch.testing.assert_close(batch.batch["response_mask"], expected_mask)
    assert metrics["rollout_corr/rollout_is_max"] == 2.0
    assert abs(metrics["rollout_corr/rollout_rs_masked_fraction"] - 1 / RESPONSE) < 1e-6
    assert abs(metrics["rollout_corr/kl"] + L2 / RESPONSE) < 1e-6


def test_off_by_default(tmp_path):
    cfg, actor, metrics = _step(tmp_path)
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == "skip"
    (batch,) = actor.updated
    assert "rollout_is_weights" not in batch.batch.keys()
    assert not any(k.startswith("rollout_corr/") for k in metrics)


def test_bypass_mode_takes_pi_old_from_the_rollout_without_a_forward(tmp_path):
    cfg, actor, metrics = _step(tmp_path, "algorithm.rollout_correction.bypass_mode=true")
    assert "compute_log_prob" not in actor.log  # verl's bypass: no old-log-prob forward
    (batch,) = actor.updated
    torch.testing.assert_close(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])
    assert "rollout_is_weights" not in batch.batch.keys()
