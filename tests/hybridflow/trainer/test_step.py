"""PPOTrainer.step with stand-in worker groups: which group calls run, in what order, and when
the actor starts to train (trainer.critic_warmup counted as verl counts it)."""
from __future__ import annotations

import pytest
import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from tests.hybridflow.trainer.test_dynamic_sampling import PROMPT, RESPONSE, FakeActor


class Submitted:
    """A non-blocking call's future: the call is logged when submitted and when collected."""

    def __init__(self, log, name, result):
        self.log, self.name, self.result = log, name, result

    def get(self):
        self.log.append(f"get {self.name}")
        return self.result


class Group:
    """Logs every call; ``submit`` runs the call at once and logs it as submitted."""

    def __init__(self, log, pids, world_size=2):
        self.log, self.pids, self.world_size = log, pids, world_size

    def submit(self, method, batch):
        self.log.append(f"submit {method}")
        return Submitted(self.log, method, getattr(self, method)(batch, logged=False))

    def _out(self, name, batch, key, logged):
        if logged:
            self.log.append(name)
        return DataProto.from_dict({key: torch.zeros(len(batch), RESPONSE)})


class Actor(FakeActor, Group):
    def __init__(self, log):
        FakeActor.__init__(self)
        Group.__init__(self, log, pids=[1, 2])

    def compute_log_prob(self, batch, logged=True):
        return self._out("compute_log_prob", batch, "old_log_probs", logged)

    def compute_ref_log_prob(self, batch, logged=True):
        return self._out("compute_ref_log_prob", batch, "ref_log_prob", logged)

    def update_actor(self, batch, logged=True):
        self.log.append("update_actor")
        return {"actor/pg_loss": 0.0}

    def update_actor_and_critic(self, batch, logged=True):
        self.log.append("update_actor_and_critic")
        return {"actor/pg_loss": 0.0, "critic/vf_loss": 0.0}


class Critic(Group):
    def compute_values(self, batch, logged=True):
        return self._out("compute_values", batch, "values", logged)

    def update_critic(self, batch, logged=True):
        if logged:
            self.log.append("update_critic")
        return {"critic/vf_loss": 0.0}


def _trainer(tmp_path, critic_pids, *overrides):
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.cli import compose_config

    cfg = load_config(compose_config("ppo", [
        f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "trainer.balance_batch=false", *overrides]))
    rows = [{"input_ids": torch.full((PROMPT,), i), "attention_mask": torch.ones(PROMPT, dtype=torch.long),
             "position_ids": torch.arange(PROMPT), "data_source": "x", "ground_truth": "y"} for i in range(16)]
    log = []
    groups = {"actor_rollout_ref": Actor(log), "critic": Critic(log, pids=critic_pids)}
    trainer = PPOTrainer(cfg, groups, None, ResumablePromptLoader(rows, 4, shuffle=False), None, None, None,
                         progress=False)

    def score(batch):
        token = torch.zeros(len(batch), RESPONSE)
        token[:, -1] = 1.0
        return token, [1.0] * len(batch), {}, {}, None

    trainer.score = score
    return trainer, log


def _step(trainer):
    trainer.global_step += 1  # as fit counts: the first step is step 1
    return trainer.step(DataProto.from_single_dict(trainer.train_loader.next_batch()))


@pytest.mark.parametrize("warmup", [0, 1, 2, 3])
def test_critic_warmup_counts_as_verl(tmp_path, warmup):
    """verl updates the actor when critic_warmup <= global_steps, its steps counted from 1:
    critic_warmup=k trains only the critic for the first k - 1 steps."""
    trainer, log = _trainer(tmp_path, [1, 2], f"trainer.critic_warmup={warmup}")
    actor_trained = []
    for _ in range(4):
        log.clear()
        metrics = _step(trainer)
        actor_trained.append("update_actor" in log)
        assert ("timing_s/update_actor" in metrics) == actor_trained[-1] and "update_critic" in log
    assert actor_trained == [warmup <= step for step in range(1, 5)]


def test_a_critic_on_the_actors_processes_runs_in_turn(tmp_path):
    trainer, log = _trainer(tmp_path, [1, 2], "algorithm.use_kl_in_reward=true")
    metrics = _step(trainer)
    # the reference is hosted by the actor's workers (no ref group): in turn too
    assert log == ["compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic", "update_actor"]
    assert {"timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/update_critic",
            "timing_s/update_actor"} <= set(metrics)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_critic_on_a_pool_of_its_own_works_while_the_actor_does(tmp_path, overlap):
    trainer, log = _trainer(tmp_path, [3, 4], f"trainer.overlap_separate_pools={overlap}")
    metrics = _step(trainer)
    if overlap:
        assert log == ["submit compute_values", "compute_log_prob", "get compute_values",
                       "submit update_critic", "update_actor", "get update_critic"]
    else:
        assert log == ["compute_log_prob", "compute_values", "update_critic", "update_actor"]
    assert {"timing_s/values", "timing_s/update_critic", "timing_s/update_actor"} <= set(metrics)


def test_the_fused_update_replaces_both_updates_once_the_actor_trains(tmp_path):
    """stage_fusion.fuse_actor_critic_update: one call on the actor's group does both updates
    (workers/fused_update.py); the critic-only warm-up steps stay plain critic updates."""
    trainer, log = _trainer(tmp_path, [1, 2], "stage_fusion.fuse_actor_critic_update=true", "trainer.critic_warmup=2")
    metrics = _step(trainer)
    assert log[-1] == "update_critic" and "update_actor_and_critic" not in log
    log.clear()
    metrics = _step(trainer)
    assert log == ["compute_log_prob", "compute_values", "update_actor_and_critic"]
    assert "timing_s/update_actor_critic" in metrics and "timing_s/update_actor" not in metrics
    assert {"actor/pg_loss", "critic/vf_loss"} <= set(metrics)
