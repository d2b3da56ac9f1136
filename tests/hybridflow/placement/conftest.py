"""Shared by the planner's config tests: a PPO config (critic, reference, reward model) whose model
folders hold only a config.json (the planner reads shapes, never weights)."""
import json
import os

import pytest


def write_config(path):
    """A model folder with only its config.json (the planner reads shapes, never weights)."""
    os.makedirs(path, exist_ok=True)
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
           "tie_word_embeddings": True, "max_position_embeddings": 512}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture
def ppo_overrides(tmp_path):
    model = write_config(str(tmp_path / "policy"))
    rm = write_config(str(tmp_path / "rm"))
    return [f"actor_rollout_ref.model.path={model}", f"reward_model.model.path={rm}", "reward_model.enable=true",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.param_dtype=bf16",
            "critic.param_dtype=bf16", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_prompt_length=16", "data.max_response_length=8", "trainer.n_gpus_per_node=2"]
