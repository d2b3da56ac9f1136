"""The long-tail counting workload's model (issue 32 item 1): the e2e bench's medium shape, warm-started
by the SFT recipe until its sampled answers have the task's length profile, then cached.

    .venv/bin/python scripts/bench/workloads/count_model.py [--rebuild]

``build_longtail_assets()`` (import with scripts/bench on sys.path: ``from workloads.count_model
import build_longtail_assets``) builds what is missing under ``data/`` and returns the paths:

- ``data/count/``: the task's train/val parquet (``hybridflow.data.count``, its defaults) and
  prompt/response pairs for SFT (``sft_train.parquet``, ``sft_val.parquet``), as the demo does;
- ``data/models/qwen2-medium-init``: the seeded random checkpoint (``SIZES["medium"]`` of e2e.py);
- ``data/models/qwen2-medium-count-sft``: the warm-started one, with ``build.json`` beside it
  (the profile and scores measured when it was built), which a later call returns at once.

Warm start: SFT rounds through ``recipes.main_sft`` (the public entry point, as the demo), each
resuming the previous round's checkpoint (``trainer.resume_mode=auto``; the LR is constant, so a
longer ``total_training_steps`` only continues the run). After each round the exported model is
sampled on the validation prompts (``count_sample.py``: vLLM at temperature 1, 256 new tokens, in
a subprocess) and stops as soon as the sampled response lengths' p50, p80 and p95 are each within
``TOLERANCE`` of the answers' (EOS counted, as the rollout's ``response_length``), or at
``MAX_STEPS``. It stops on the length profile, not on the score, on purpose: GRPO must still have
room to raise the score in the time-to-accuracy benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(BENCH))
DATA = "data/count"
INIT_MODEL = "data/models/qwen2-medium-init"
SFT_MODEL = "data/models/qwen2-medium-count-sft"
SFT_RUN = "runs/count-sft"  # the SFT rounds' checkpoints (resumed from round to round)
PERCENTILES = (50, 80, 95)
TOLERANCE = 0.25  # relative, per percentile (see profile_gaps)
ROUND_STEPS = (40, 20, 20, 20, 20, 20)  # SFT steps per round; their sum is the step cap
MAX_STEPS = sum(ROUND_STEPS)
SAMPLES_PER_PROMPT = 4

SFT_OVERRIDES = [
    f"data.train_files=[{DATA}/sft_train.parquet]", f"data.val_files=[{DATA}/sft_val.parquet]",
    f"model.path={INIT_MODEL}", f"trainer.hf_output_dir={SFT_MODEL}", f"trainer.default_local_dir={SFT_RUN}",
    # the longest prompt (17 tokens) + the longest answer with EOS (256)
    "data.max_length=280", "data.apply_chat_template=false",
    "data.train_batch_size=32", "data.micro_batch_size_per_gpu=4",
    "optim.lr=1e-3", "optim.weight_decay=0.0", "trainer.total_epochs=100",
    "trainer.n_gpus_per_node=2", "model.param_dtype=bf16", "model.fsdp_config.fsdp_size=1",
    "trainer.test_freq=1000", "trainer.save_freq=1000", "trainer.resume_mode=auto", "trainer.logger=[console,jsonl]",
]


def percentile_profile(lengths) -> dict:
    """p50/p80/p95 (numpy's linear interpolation), mean and max of response lengths in tokens."""
    import numpy as np

    a = np.asarray(lengths, dtype=float)
    out = {f"p{q}": round(float(np.percentile(a, q)), 1) for q in PERCENTILES}
    return {**out, "mean": round(float(a.mean()), 1), "max": int(a.max())}


def profile_gaps(sampled: dict, data: dict) -> dict:
    """Per percentile, the sampled value's relative gap to the data's: sampled / data - 1."""
    return {f"p{q}": round(sampled[f"p{q}"] / data[f"p{q}"] - 1, 3) for q in PERCENTILES}


def profile_matches(sampled: dict, data: dict, tolerance: float = TOLERANCE) -> bool:
    return all(abs(g) <= tolerance for g in profile_gaps(sampled, data).values())


def write_sft_pairs(data_dir: str) -> None:
    """``sft_{train,val}.parquet`` (columns prompt, response) from the task's RL rows, as the demo's."""
    import pandas as pd

    for split in ("train", "val"):
        rows = pd.read_parquet(os.path.join(data_dir, f"{split}.parquet"))
        pd.DataFrame({"prompt": rows["prompt"], "response": [r["ground_truth"] for r in rows["reward_model"]]}
                     ).to_parquet(os.path.join(data_dir, f"sft_{split}.parquet"), index=False)


def sample_profile(model: str, parquet: str, n: int = SAMPLES_PER_PROMPT) -> dict:
    """Sample ``model`` on ``parquet``'s prompts (count_sample.py, a process of its own); its
    sampled and greedy length profiles and mean scores, and the answers' length profile."""
    import statistics

    cmd = [sys.executable, os.path.join(BENCH, "workloads", "count_sample.py"), model, parquet, "--n", str(n)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "sampled": percentile_profile(raw["sampled"]["lengths"]),
        "data": percentile_profile(raw["data_lengths"]),
        "greedy": percentile_profile(raw["greedy"]["lengths"]),
        "sampled_score": round(statistics.mean(raw["sampled"]["scores"]), 4),
        "greedy_score": round(statistics.mean(raw["greedy"]["scores"]), 4),
        "prompts": raw["prompts"], "samples_per_prompt": raw["n"],
        "seconds": round(raw["engine_s"] + raw["sampled"]["seconds"] + raw["greedy"]["seconds"], 1),
    }


def _build_inputs() -> None:
    sys.path.insert(0, BENCH)
    from e2e import SIZES

    from hybridflow.data.count import write_count_parquet
    from hybridflow.tiny import make_tiny_checkpoint

    if not os.path.exists(f"{DATA}/sft_val.parquet"):
        write_count_parquet(DATA)
        write_sft_pairs(DATA)
    if not os.path.exists(f"{INIT_MODEL}/config.json"):
        make_tiny_checkpoint(INIT_MODEL, "qwen2", seed=0, **SIZES["medium"])


def _sft(total_steps: int) -> None:
    """One SFT round up to ``total_steps`` in all, resumed from the last round, in a process of its
    own: each round's Ray starts and stops with it, and none outlives the build."""
    code = ("import sys; from recipes import main_sft; "
            "main_sft.run(main_sft.load_and_validate(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, *SFT_OVERRIDES, f"trainer.total_training_steps={total_steps}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"SFT round to step {total_steps} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def build_longtail_assets(root: str = REPO, rebuild: bool = False) -> dict:
    """Paths of the workload's data and models (built when missing; see the module docstring)."""
    os.chdir(root)
    sys.path.insert(0, root)
    paths = {"data": os.path.join(root, DATA), "model": os.path.join(root, SFT_MODEL),
             "init_model": os.path.join(root, INIT_MODEL)}
    record = os.path.join(SFT_MODEL, "build.json")
    if os.path.exists(record) and not rebuild:
        with open(record) as f:
            return {**json.load(f), **paths, "built": False}
    start = time.perf_counter()
    for stale in (SFT_MODEL, SFT_RUN):
        shutil.rmtree(stale, ignore_errors=True)
    _build_inputs()
    steps, rounds = 0, []
    for n in ROUND_STEPS:
        steps += n
        t0 = time.perf_counter()
        _sft(steps)
        sft_s = time.perf_counter() - t0
        profile = sample_profile(SFT_MODEL, f"{DATA}/val.parquet")
        rounds.append({"steps": steps, "sft_s": round(sft_s, 1), "sample_s": profile["seconds"],
                       "sampled": profile["sampled"], "sampled_score": profile["sampled_score"]})
        print(f"count_model: {steps} SFT steps, sampled {profile['sampled']} vs data {profile['data']}",
              file=sys.stderr, flush=True)
        if profile_matches(profile["sampled"], profile["data"]):
            break
    result = {"sft_steps": steps, "matched": profile_matches(profile["sampled"], profile["data"]),
              "tolerance": TOLERANCE, "profile": profile, "gaps": profile_gaps(profile["sampled"], profile["data"]),
              "rounds": rounds, "build_s": round(time.perf_counter() - start, 1), "sft_overrides": SFT_OVERRIDES}
    with open(record, "w") as f:
        json.dump(result, f, indent=2)
    return {**result, **paths, "built": True}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rebuild", action="store_true", help="rebuild the SFT model even if it is cached")
    args = p.parse_args(argv)
    print(json.dumps(build_longtail_assets(rebuild=args.rebuild), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
