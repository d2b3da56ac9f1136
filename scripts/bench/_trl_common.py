"""What the TRL baselines share: the task's reward (our file, so both frameworks score alike), the
prompts as TRL wants them, and TRL itself, installed into this venv when missing.

TRL is never imported by the package: only the bench scripts that compare against it do, in
their own processes. ``ensure_trl`` pins torch and transformers to the versions already
installed, so installing TRL cannot move the venv's torch or transformers (TRL 1.16 adds
accelerate, datasets and multiprocess, nothing else, on this venv).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRL_REQUIREMENT = "trl==1.16.*"
# data_source -> the reward file under hybridflow/rewards/ (each needs only the standard library)
REWARD_FILES = {"arithmetic": "arithmetic.py", "count": "count.py"}


def ensure_trl(python: str = sys.executable) -> None:
    """Install TRL (and its accelerate/datasets) into ``python``'s environment if it lacks it."""
    probe = subprocess.run([python, "-c", "import trl, datasets, accelerate"], capture_output=True)
    if probe.returncode == 0:
        return
    versions = subprocess.run(
        [python, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
        capture_output=True, text=True, check=True).stdout.split()
    pins = [f"torch=={versions[0]}", f"transformers=={versions[1]}"]
    print(f"installing {TRL_REQUIREMENT} into {sys.prefix if python == sys.executable else python} "
          f"(pinned: {' '.join(pins)})", file=sys.stderr)
    subprocess.run([python, "-m", "pip", "install", "-q", TRL_REQUIREMENT, "datasets", "accelerate", *pins],
                   check=True)


def has_trl() -> bool:
    return importlib.util.find_spec("trl") is not None


def load_score(data_source: str):
    """hybridflow's ``compute_score(solution_str, ground_truth)`` for ``data_source``, imported from
    its file, so a TRL process needs no hybridflow install and scores with the same code."""
    if data_source not in REWARD_FILES:
        raise SystemExit(f"unknown task {data_source!r}: use one of {sorted(REWARD_FILES)}")
    path = os.path.join(REPO, "hybridflow", "rewards", REWARD_FILES[data_source])
    spec = importlib.util.spec_from_file_location(f"hf_{data_source}_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def load_prompts(parquet: str):
    """verl-schema rows -> a datasets.Dataset with a plain-text ``prompt`` (the last message: the
    char tokenizer has no chat template) and its ``ground_truth``."""
    import pandas as pd
    from datasets import Dataset

    rows = pd.read_parquet(parquet)
    prompts = [list(p)[-1]["content"] for p in rows["prompt"]]
    truths = [str(r["ground_truth"]) for r in rows["reward_model"]]
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def load_policy(model_path: str, attn_implementation: str | None = None):
    """The checkpoint in fp32 (as our recipes load it) and its char tokenizer, left-padded for
    generation. transformers 5 ignores a custom tokenizer.json under a qwen2 config with
    AutoTokenizer (docs/environment.md), so the tokenizer is loaded as what it is.
    ``attn_implementation`` (eager, sdpa; None: transformers' default, sdpa) is what a TRL user
    passes in ``GRPOConfig.model_init_kwargs``; the model is built here, so it is passed here."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **kwargs), tokenizer


def reward_func(data_source: str):
    """A TRL reward function (``completions, ground_truth, **kwargs -> list[float]``) for the task."""
    compute_score = load_score(data_source)

    def reward(completions, ground_truth, **_):
        return [float(compute_score(c, gt)) for c, gt in zip(completions, ground_truth)]

    reward.__name__ = f"{data_source}_reward"
    return reward


def steps_between_validations(prompts_between: int, prompts_per_step: int) -> int:
    """Optimizer steps between two validations so that both frameworks validate after the same
    number of training prompts (ours every test_freq steps of train_batch_size prompts; TRL's
    default step holds 1 prompt). Refuses a spacing its batch cannot hit exactly."""
    if prompts_per_step < 1 or prompts_between < prompts_per_step or prompts_between % prompts_per_step:
        raise ValueError(f"validating every {prompts_between} prompts needs a whole number of steps of "
                         f"{prompts_per_step} prompts")
    return prompts_between // prompts_per_step
