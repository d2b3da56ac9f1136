"""reward_model.launch_reward_fn_async: the reward function scores on a driver thread while the
step goes on, and its scores land on the right rows after the batch was reordered."""
from __future__ import annotations

import threading
import time

import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.generations import RESPONSE_TEXT, take_carried
from tests.hybridflow.trainer.test_dynamic_sampling import PROMPT, RESPONSE, FakeActor


def _trainer(tmp_path, *overrides):
    from hybridflow.config import compose_config, load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2",
                                              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                                              f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", *overrides]))
    rows = [{"input_ids": torch.full((PROMPT,), i), "attention_mask": torch.ones(PROMPT, dtype=torch.long),
             "position_ids": torch.arange(PROMPT), "data_source": "x", "ground_truth": "y"} for i in range(4)]
    trainer = PPOTrainer(cfg, {"actor_rollout_ref": FakeActor()}, None, ResumablePromptLoader(rows, 4, shuffle=False),
                         None, None, None, progress=False)
    trainer.scored_on = []

    def score(batch):  # row r scores 10 * prompt + r: every row's score is its own
        trainer.scored_on.append(threading.current_thread().name)
        time.sleep(0.3)  # a slow reward function
        prompt = batch.batch["responses"][:, 0]
        scores = (10 * prompt + torch.arange(len(prompt))).float()
        token = torch.zeros(len(scores), RESPONSE)
        token[:, -1] = scores
        texts = [f"row {r}" for r in range(len(scores))]
        return token, scores.tolist(), {"reward/x": 1.0}, {"acc": [bool(r % 2) for r in range(len(scores))]}, texts

    trainer.score = score
    return trainer


def test_scores_come_from_the_reward_thread_and_follow_the_reordered_rows(tmp_path):
    trainer = _trainer(tmp_path, "reward_model.launch_reward_fn_async=true")
    batch = DataProto.from_single_dict(trainer.train_loader.next_batch())
    started = time.perf_counter()
    batch, _, _, pending = trainer._rollout(batch, metrics := {})
    assert time.perf_counter() - started < 0.25 and not pending.done()  # the step did not wait for it
    assert "token_level_scores" not in batch.batch.keys()
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])  # what balance_batch may do meanwhile
    batch = batch.reorder(order)
    trainer._apply_scores(batch, pending.result(), metrics, order)
    assert trainer.scored_on[0].startswith("reward")
    expected = (10 * torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]) + torch.arange(8)).float()[order]
    assert torch.equal(batch.batch["token_level_scores"][:, -1], expected)
    assert metrics["reward/x"] == 1.0
    carried = take_carried(batch)
    assert list(carried["texts"]) == [f"row {r}" for r in order.tolist()]
    assert [e["acc"] for e in carried["extras"]] == [bool(r % 2) for r in order.tolist()]
    assert RESPONSE_TEXT not in batch.non_tensor_batch


def test_without_the_key_or_with_dynamic_sampling_the_scores_are_on_the_batch_at_once(tmp_path):
    for overrides in ([], ["reward_model.launch_reward_fn_async=true", "algorithm.filter_groups.enable=true"]):
        trainer = _trainer(tmp_path, *overrides)
        assert trainer.reward_thread is None
        batch, _, _, pending = trainer._rollout(DataProto.from_single_dict(trainer.train_loader.next_batch()), {})
        assert pending is None and "token_level_scores" in batch.batch.keys()
        assert trainer.scored_on == [threading.main_thread().name]
