"""Helpers for tests that run the real ``recipes.main_ppo`` in a subprocess on a tiny model.

The run is fp32 on CPU with two workers; data is the synthetic arithmetic task, sized so that an
epoch is exactly ``steps_per_epoch`` steps, and the reward is a graded one (fraction of digit
characters) so that a random model's scores and losses differ between samples and steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Graded: the fraction of digit characters in the response."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def make_assets(root: Path, train_size: int = 16, val_size: int = 8, arch: str = "qwen2") -> dict:
    from hybridflow.data import write_arithmetic_parquet
    from hybridflow.data.arithmetic import ArithmeticTaskConfig
    from hybridflow.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(str(root / "model"), arch)
    train, val = write_arithmetic_parquet(str(root / "data"),
                                          ArithmeticTaskConfig(train_size=train_size, val_size=val_size))
    reward = root / "digits.py"
    reward.write_text(DIGIT_REWARD)
    return {"model": str(root / "model"), "train": train, "val": val, "reward": str(reward)}


def recipe_args(assets: dict, out_dir: Path | str, *extra: str) -> list[str]:
    """``recipes.main_ppo`` grpo overrides for a tiny fp32 run on two CPU workers."""
    return ["--config-name", "grpo",
            f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            "data.train_batch_size=8", f"actor_rollout_ref.model.path={assets['model']}",
            f"custom_reward_function.path={assets['reward']}",
            "trainer.n_gpus_per_node=2", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out_dir}", *extra]


def recipe_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               HYBRIDFLOW_DEVICE="cpu", PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    return env


def recipe_cmd(assets: dict, out_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "recipes.main_ppo", *recipe_args(assets, out_dir, *extra)]


def run_recipe(assets: dict, out_dir, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run(recipe_cmd(assets, out_dir, *extra), cwd=REPO, env=recipe_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_steps(out_dir) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (a killed run resumed) keeps its last record."""
    steps = {}
    with open(Path(out_dir) / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            steps[record["step"]] = record
    return steps
