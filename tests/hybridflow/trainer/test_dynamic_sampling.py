"""algorithm.filter_groups (DAPO's dynamic sampling): which prompts are kept, and the trainer's
loop that generates further batches until data.train_batch_size of them are found."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from hybridflow.algorithms.dynamic_sampling import DynamicSamplingError, informative_rows, metric_values

PROMPT, RESPONSE = 3, 2


def test_prompts_whose_samples_all_score_the_same_are_dropped():
    uids = np.array(["a", "a", "b", "b", "c"])
    values = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    assert informative_rows(uids, values).tolist() == [True, True, False, False, True]  # "c": one sample
    assert metric_values("acc", [0.2, 0.2], {"acc": [True, False]}).tolist() == [1.0, 0.0]
    with pytest.raises(DynamicSamplingError, match="returned no 'acc' field"):
        metric_values("acc", [0.2, 0.2], {})


class FakeActor:
    """Generates responses whose token 0 is the prompt's id; world size 2 (two dp ranks)."""

    world_size = 2

    def __init__(self):
        self.calls = 0

    def generate_sequences(self, gen_in):
        self.calls += 1
        n = gen_in.meta_info["n"]
        ids = gen_in.batch["input_ids"].repeat_interleave(n, 0)
        responses = ids[:, :1].repeat(1, RESPONSE)
        mask = torch.ones(len(ids), PROMPT + RESPONSE, dtype=torch.long)
        return DataProto.from_dict({"responses": responses, "response_mask": torch.ones_like(responses),
                                    "input_ids": torch.cat([ids, responses], 1), "attention_mask": mask,
                                    "position_ids": mask.cumsum(-1) - 1})


def _trainer(tmp_path, informative: set[int], *overrides):
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.cli import compose_config

    cfg = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2",
                                              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                                              "algorithm.filter_groups.enable=true", *overrides]))
    rows = [{"input_ids": torch.full((PROMPT,), i), "attention_mask": torch.ones(PROMPT, dtype=torch.long),
             "position_ids": torch.arange(PROMPT), "data_source": "x", "ground_truth": "y"} for i in range(12)]
    loader = ResumablePromptLoader(rows, 4, shuffle=False)
    trainer = PPOTrainer(cfg, {"actor_rollout_ref": FakeActor()}, None, loader, None, None, None, progress=False)

    def score(batch):  # prompt i's two samples score 0 and 1 when i is informative, else 1 and 1
        prompt = batch.batch["responses"][:, 0].tolist()
        scores = [float(p not in informative or row % 2) for row, p in enumerate(prompt)]
        token = torch.zeros(len(scores), RESPONSE)
        token[:, -1] = torch.tensor(scores)
        return token, scores, {}, {}, None  # no decoded texts, as from a reward model

    trainer.score = score
    return trainer


def test_the_trainer_generates_more_batches_until_enough_prompts_differ(tmp_path):
    trainer = _trainer(tmp_path, informative={1, 3, 4, 9, 10, 11})
    metrics = {}
    first = DataProto.from_single_dict(trainer.train_loader.next_batch())  # prompts 0-3: two informative
    batch, baselines, values, _ = trainer._rollout(first, metrics)
    batch, _ = trainer._keep_informative_prompts(batch, baselines, values, metrics)
    # 1 and 3 from the first batch, 4 from the second (5-7 all equal), 9 from the third
    assert batch.batch["responses"][:, 0].tolist() == [1, 1, 3, 3, 4, 4, 9, 9]
    assert metrics["filter_groups/num_gen_batches"] == 3 and trainer.actor.calls == 3
    assert metrics["filter_groups/kept_prompts_frac"] == 6 / 12  # 10 and 11 differ too, beyond the 4 kept
    assert trainer.train_loader.batch_in_epoch == 3  # the loader moved on: the next step starts at 12


def test_the_generation_budget_ends_the_step_with_a_clear_error(tmp_path):
    trainer = _trainer(tmp_path, {1}, "algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(DynamicSamplingError, match="1 of the 4 prompts had samples that differ after 2 generation"):
        trainer.step(DataProto.from_single_dict(trainer.train_loader.next_batch()))
