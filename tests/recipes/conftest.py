"""Shared assets for the recipe smoke tests: one tiny policy, one tiny reward model, a small
arithmetic data set and a graded reward function, built once per session."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A random policy almost never answers an arithmetic prompt right, so the built-in scorer gives
# every sample 0 and GRPO's group-normalised advantages are all 0: no gradient, no test. This
# score is graded (the share of digit characters in the response), so samples of one prompt differ.
DIGIT_FRACTION_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
'''


@dataclass(frozen=True)
class RecipeAssets:
    model: str  # tiny Qwen2 causal LM + char tokenizer
    reward_model: str  # tiny Qwen2 sequence classifier (num_labels=1) on the same tokenizer
    train_file: str
    val_file: str
    reward_fn: str  # a .py file defining compute_score

    def overrides(self, out_dir: str) -> list[str]:
        """The overrides every smoke run shares: these assets, 2 worker slots, a 2-step budget."""
        return [f"data.train_files=[{self.train_file}]", f"data.val_files=[{self.val_file}]",
                f"actor_rollout_ref.model.path={self.model}", f"custom_reward_function.path={self.reward_fn}",
                "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", "trainer.test_freq=2",
                "data.max_response_length=8", "actor_rollout_ref.actor.optim.lr=1e-3",
                f"trainer.default_local_dir={out_dir}"]


@pytest.fixture(scope="session")
def recipe_assets(tmp_path_factory) -> RecipeAssets:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hybridflow.data import write_arithmetic_parquet
    from hybridflow.data.arithmetic import ArithmeticTaskConfig
    from hybridflow.tiny import make_tiny_checkpoint, save_char_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("recipe_assets")
    model = make_tiny_checkpoint(str(root / "policy"), "qwen2", seed=0)
    rm_config = tiny_config("qwen2")
    rm_config.num_labels = 1  # tiny_config already sets pad_token_id, which the classifier needs
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_config(rm_config)
    rm.save_pretrained(str(root / "rm"))
    save_char_tokenizer(str(root / "rm"))
    train, val = write_arithmetic_parquet(str(root / "data"), ArithmeticTaskConfig(train_size=64, val_size=8))
    reward_fn = root / "digit_reward.py"
    reward_fn.write_text(DIGIT_FRACTION_REWARD)
    return RecipeAssets(model, str(root / "rm"), train, val, str(reward_fn))


def run_main_ppo(config_name: str, overrides: list[str], timeout: float = 420,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m recipes.main_ppo`` in a fresh process (its own Ray instance), from the repo root;
    ``env`` is added to this process's environment."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HYBRIDFLOW_PROGRESS", None)
    return subprocess.run([sys.executable, "-m", "recipes.main_ppo", "--config-name", config_name, *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ray_starts(monkeypatch) -> list:
    """The calls the code under test made to ``ray.init``, each refused (a check that must end
    before Ray fails loudly instead of starting it). ``ray.is_initialized`` answers False: the
    session's shared Ray instance may be up, and main_ppo would join it instead of starting one."""
    import ray

    calls: list = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise RuntimeError("ray.init called before the input was checked")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    return calls
