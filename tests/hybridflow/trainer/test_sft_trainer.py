"""The SFT trainer's loop with stand-in workers: a NaN/inf loss or gradient norm stops the run
before that step is saved (as in the RL trainer, tests/hybridflow/trainer/test_checkpoint_safety.py),
and each step's record is logged before its checkpoint is written."""
from __future__ import annotations

import os

import numpy as np
import pytest

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.trainer import checkpoint as ckpt
from tests.hybridflow.trainer.test_checkpoint import FakeGroup
from tests.hybridflow.trainer.test_checkpoint_safety import ListTracker


class FakeSFTGroup(FakeGroup):
    """A worker group whose train step reports the losses in ``losses`` (step 1 first)."""

    def __init__(self, world_size, losses):
        super().__init__(world_size)
        self.losses = list(losses)

    def train_step(self, batch):
        return {"nll": self.losses.pop(0), "grad_norm": 1.0, "lr": 1e-3}


def _sft_trainer(tmp_path, losses, *overrides):
    from hybridflow.config.sft import SFTConfig, load_sft_config
    from hybridflow.trainer.sft_trainer import SFTTrainer
    from recipes.cli import compose_config

    cfg = load_sft_config(compose_config("sft", [f"trainer.default_local_dir={tmp_path / 'run'}",
                                                 "trainer.n_gpus_per_node=2", *overrides], schema=SFTConfig))
    loader = ResumablePromptLoader(list(range(24)), 8, seed=3, collate_fn=lambda rows: {"x": np.array(rows)})
    return SFTTrainer(cfg, FakeSFTGroup(2, losses), loader, None, None, progress=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_sft_loss_stops_before_its_step_is_saved(tmp_path, bad):
    from hybridflow.trainer.finite import NonFiniteError

    trainer = _sft_trainer(tmp_path, [0.5, bad, 0.4], "trainer.save_freq=1", "trainer.total_training_steps=3")
    events = []
    trainer.tracker = ListTracker(events)
    original_save = trainer.save_checkpoint
    trainer.save_checkpoint = lambda: (events.append(f"save {trainer.global_step}"), original_save())[1]
    with pytest.raises(NonFiniteError, match=rf"step 2: train/loss is {bad} .* without saving this step.* the newest "
                                             r"checkpoint that verifies is .*global_step_1: .*optim\.lr"):
        trainer.fit()
    root = str(tmp_path / "run")
    assert events == ["log 1", "save 1", "log 2"]  # the record first: a kill before the save keeps it
    assert ckpt.read_tracker(root) == 1 and not os.path.exists(ckpt.step_dir(root, 2))
    assert "timing_s/save_checkpoint" in trainer.tracker.records[1][1]  # step 1's save, in the next record


def test_the_sft_stop_line_is_one_line_and_exits_non_zero(tmp_path, capsys):
    from types import SimpleNamespace

    from hybridflow.trainer.finite import NonFiniteError
    from recipes.main_ppo import report_stop

    trainer = _sft_trainer(tmp_path, [float("nan")], "trainer.save_freq=1", "trainer.total_training_steps=1")
    trainer.tracker = ListTracker([])
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit()
    assert "no checkpoint was saved before it" in str(caught.value)
    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path / "run"), save_freq=1,
                                                  resume_mode="auto"))
    assert report_stop(cfg, caught.value) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"training stopped: {caught.value}" and len(lines) == 2
