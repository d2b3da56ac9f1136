"""Smoke tests of ``python -m recipes.main_sft`` through the real entry point.

Three runs on two CPU workers and a tiny Qwen2 (fp32), 16 prompt/response pairs, 8 per step, so
an epoch is 2 steps, all with LoRA adapters on every linear layer (the adapters are the engine's
only trainable parameters; the full fine-tuning path is the same recipe without them, and the
engine tests cover it):
- A: sharded FSDP, 2 epochs (4 steps) uninterrupted: the reference. Its NLL must fall, its HF
  export must load in transformers, and ``scripts/export_hf.py`` of its last checkpoint must give
  the same weights as the engine's own HF export (adapters merged in both).
- B: the replicated layout (``model.fsdp_config.fsdp_size=1``) stopped after 2 steps with a
  checkpoint, then started again, sharded, with ``resume_mode=auto`` to finish the 4 steps (a
  checkpoint is not tied to ``fsdp_size``). Its per-step NLL and final weights must match A's.
  The two layouts reduce gradients in a different order, so the comparison allows fp32 rounding
  (1e-5) and no more: a resume that lost the optimizer state or the data position is off by
  orders of magnitude more at lr 5e-3.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.recipes.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_assets(tmp_path_factory) -> dict:
    import pandas as pd

    from hybridflow.data import write_arithmetic_parquet
    from hybridflow.data.arithmetic import ArithmeticTaskConfig
    from hybridflow.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("sft_assets")
    model = make_tiny_checkpoint(str(root / "model"), "qwen2", seed=0)
    files = {}
    for split, path in zip(("train", "val"), write_arithmetic_parquet(
            str(root / "rl"), ArithmeticTaskConfig(train_size=16, val_size=8))):
        rows = pd.read_parquet(path)
        pairs = pd.DataFrame({"prompt": rows["prompt"],
                              "response": [r["ground_truth"] for r in rows["reward_model"]]})
        files[split] = str(root / f"sft_{split}.parquet")
        pairs.to_parquet(files[split], index=False)
    return {"model": model, **files}


def run_sft(assets: dict, out_dir, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false", "HYBRIDFLOW_DEVICE": "cpu"}
    env.pop("RAY_ADDRESS", None)
    env.pop("HYBRIDFLOW_PROGRESS", None)
    args = [f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            f"model.path={assets['model']}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
            "optim.lr=1e-3", "trainer.n_gpus_per_node=2", "trainer.total_epochs=2", "trainer.save_freq=2",
            "trainer.logger=[jsonl]", f"trainer.default_local_dir={out_dir}",
            f"trainer.hf_output_dir={out_dir}/hf", *extra]
    proc = subprocess.run([sys.executable, "-m", "recipes.main_sft", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def read_metrics(out_dir) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: row for row in rows}


def hf_weights(path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_sft_lora_sharded_then_replicated_resume_matches(sft_assets, tmp_path):
    """SFT with verl's model.lora_rank (the adapters train, the model stays frozen): a run killed
    after step 2 under another FSDP layout resumes to the same steps 3-4 and weights; the HF output
    and the offline export of the checkpoint are the same plain model (adapters merged), in which
    only the adapted weights moved."""
    import torch

    from workers.export import export

    ref_dir, resumed_dir = tmp_path / "sharded", tmp_path / "replicated"
    lora = ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=5e-3"]
    sharded = ["model.fsdp_config.fsdp_size=-1"]  # auto would replicate a model this small on CPU
    run_sft(sft_assets, ref_dir, *lora, *sharded)
    ref = read_metrics(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4]
    assert ref[4]["train/nll"] < ref[1]["train/nll"]
    assert ref[4]["train/loss"] == ref[4]["train/nll"] and ref[4]["val/loss"] == ref[4]["val/nll"]  # verl's names
    assert ref[2]["val/nll"] > ref[4]["val/nll"]  # validation after each epoch (test_freq=-1)
    assert sorted(os.listdir(ref_dir / "global_step_4")) == ["actor", "manifest.json", "trainer_state.json"]
    initial, trained = hf_weights(sft_assets["model"]), hf_weights(str(ref_dir / "hf"))
    moved = {k for k in initial if not torch.equal(initial[k], trained[k])}
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert moved == {k for k in initial if k.endswith(tuple(f"{n}.weight" for n in linear))}, moved
    exported = hf_weights(export(str(ref_dir), str(tmp_path / "exported")))
    assert exported.keys() == trained.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)

    replicated = ["model.fsdp_config.fsdp_size=1"]
    run_sft(sft_assets, resumed_dir, *lora, *replicated, "trainer.total_training_steps=2")
    assert not (resumed_dir / "global_step_4").exists()
    proc = run_sft(sft_assets, resumed_dir, *lora, *sharded, "trainer.resume_mode=auto")  # sharded from here on
    assert "resumed from" in proc.stdout + proc.stderr
    got = read_metrics(resumed_dir)
    for step in (3, 4):
        assert got[step]["train/nll"] == pytest.approx(ref[step]["train/nll"], abs=1e-5, rel=0), step
    assert got[4]["val/nll"] == pytest.approx(ref[4]["val/nll"], abs=1e-5, rel=0)
    resumed = hf_weights(str(resumed_dir / "hf"))
    for name, tensor in trained.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-5, msg=name)
