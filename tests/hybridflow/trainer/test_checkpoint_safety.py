"""What a checkpoint folder may not do to a run: run code (a crafted trainer state or RNG file),
resume silently from changed bytes (content hashes), restart over its checkpoints when the tracker
is gone, leave a partial folder after a failed save, or be named in a stop line when it does not
verify. Engine files (DCP, extra_rank, megatron) are in tests/workers/engines/test_dcp_reader.py."""
from __future__ import annotations

import errno
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch

from hybridflow.trainer import checkpoint as ckpt
from tests.hybridflow.trainer.test_checkpoint import FakeGroup, _trainer


class RunsCode:
    """A pickle that, when loaded without restriction, creates ``marker``: a stand-in for a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved_run(tmp_path, steps=(1, 2)):
    """A run folder with real checkpoints of the trainer (stand-in workers) at ``steps``."""
    trainer = _trainer(tmp_path, 2, "trainer.save_freq=1")
    for step in steps:
        trainer.global_step = step
        trainer.save_checkpoint()
    return trainer, str(tmp_path / "run")


def test_a_crafted_trainer_state_runs_no_code_even_with_a_regenerated_manifest(tmp_path):
    trainer, root = _saved_run(tmp_path)
    path = ckpt.step_dir(root, 2)
    marker = tmp_path / "pwned"
    for payload in (pickle.dumps({"global_step": 2, "x": RunsCode(marker)}), b"\x00garbage\xff" * 10):
        with open(os.path.join(path, ckpt.TRAINER_STATE), "wb") as f:
            f.write(payload)
        ckpt.write_manifest(path, 2, trainer.worker_layout())  # the hash check alone would catch it
        with pytest.raises(ckpt.CheckpointError, match=rf"{ckpt.TRAINER_STATE} is not a trainer state.*resume_mode"):
            ckpt.open_resume(root, "auto", trainer.worker_layout())
        assert not marker.exists()
    assert ckpt.TRAINER_STATE.endswith(".json")


def test_bytes_changed_inside_a_shard_are_refused_naming_the_file(tmp_path):
    """The probe: 1 KB of NaN written inside a weight shard, size unchanged, resumed silently."""
    trainer, root = _saved_run(tmp_path)
    shard = os.path.join(ckpt.step_dir(root, 2), "actor", "rank1.pt")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * min(1024, size // 4))
    assert os.path.getsize(shard) == size
    with pytest.raises(ckpt.CheckpointError, match=r"content of \['actor/rank1.pt'\] changed.*hash mismatch.*"
                                                   r"newest checkpoint that verifies is .*global_step_1"):
        ckpt.open_resume(root, "auto", trainer.worker_layout())
    manifest = json.loads(open(os.path.join(ckpt.step_dir(root, 2), ckpt.MANIFEST)).read())
    assert manifest["format"] == ckpt.FORMAT_VERSION and set(manifest["files"]["actor/rank0.pt"]) == {"size", "sha256"}


def test_a_checkpoint_of_the_old_format_is_refused_in_one_line(tmp_path):
    trainer, root = _saved_run(tmp_path, steps=(2,))
    manifest_file = os.path.join(ckpt.step_dir(root, 2), ckpt.MANIFEST)
    manifest = json.loads(open(manifest_file).read())
    manifest["format"] = 1
    open(manifest_file, "w").write(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="has format 1; this version reads format 2 only.*disable"):
        ckpt.open_resume(root, "auto", trainer.worker_layout())


def test_without_a_tracker_auto_resumes_from_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    """The probe: the tracker deleted, resume_mode=auto started from step 0 over two checkpoints."""
    trainer, root = _saved_run(tmp_path, steps=(1, 2, 3))
    os.remove(os.path.join(root, ckpt.TRACKER))
    os.makedirs(ckpt.step_dir(root, 4))  # a save that never finished: not a checkpoint
    os.remove(os.path.join(ckpt.step_dir(root, 3), "actor", "rank0.pt"))  # damaged
    assert ckpt.find_resume_dir(root, "auto") == ckpt.step_dir(root, 2)
    assert "has no latest_checkpointed_iteration.txt: resuming from the newest checkpoint that verifies" \
        in capsys.readouterr().err
    fresh = _trainer(tmp_path, 2)
    fresh._maybe_resume()
    assert fresh.global_step == 2
    assert not os.path.exists(ckpt.step_dir(root, 4))  # the partial folder past the resume point is gone
    assert os.path.exists(ckpt.step_dir(root, 3))  # a damaged but complete one is the user's to look at

    for step in (1, 2):
        os.remove(os.path.join(ckpt.step_dir(root, step), ckpt.TRAINER_STATE))
    with pytest.raises(ckpt.CheckpointError, match=r"no latest_checkpointed_iteration.txt and none of its "
                                                   r"checkpoints \['global_step_3', 'global_step_2'"):
        ckpt.find_resume_dir(root, "auto")
    partial_only = tmp_path / "partial"
    os.makedirs(ckpt.step_dir(str(partial_only), 2))
    assert ckpt.find_resume_dir(str(partial_only), "auto") is None  # a first save that never finished


class FullDisk(FakeGroup):
    def save_checkpoint(self, path):
        super().save_checkpoint(path)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_save_that_fails_for_lack_of_space_leaves_no_partial_folder(tmp_path):
    trainer, root = _saved_run(tmp_path, steps=(1,))
    trainer.actor = FullDisk(2)
    trainer.global_step = 2
    with pytest.raises(ckpt.CheckpointSaveError, match=r"could not write checkpoint .*global_step_2 \(OSError: "
                                                       r".*No space left on device\); its partial folder was removed"):
        trainer.save_checkpoint()
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.TRACKER] and ckpt.read_tracker(root) == 1


class ListTracker:
    def __init__(self, events):
        self.events, self.records = events, []

    def drop_after(self, step):
        pass

    def log(self, metrics, step):
        self.events.append(f"log {step}")
        self.records.append((step, dict(metrics)))


def test_a_non_finite_loss_stops_before_its_step_is_saved_and_logs_come_before_saves(tmp_path):
    from hybridflow.trainer.finite import NonFiniteError

    trainer = _trainer(tmp_path, 2, "trainer.save_freq=1", "trainer.total_training_steps=3")
    events = []
    trainer.tracker = ListTracker(events)
    original_save = trainer.save_checkpoint
    trainer.save_checkpoint = lambda: (events.append(f"save {trainer.global_step}"), original_save())[1]
    trainer.step = lambda batch: {"actor/pg_loss": 0.5 if trainer.global_step == 1 else float("nan"),
                                  "actor/grad_norm": 1.0}
    trainer.train_loader.collate_fn = lambda rows: {"x": np.array(rows)}
    with pytest.raises(NonFiniteError, match=r"step 2: actor/pg_loss is nan .* without saving this step.* the newest "
                                             r"checkpoint that verifies is .*global_step_1"):
        trainer.fit()
    assert events == ["log 1", "save 1", "log 2"]  # the record first: a kill before the save keeps it
    assert ckpt.read_tracker(str(tmp_path / "run")) == 1 and not os.path.exists(ckpt.step_dir(str(tmp_path / "run"), 2))


def test_the_stop_line_names_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    from types import SimpleNamespace

    from hybridflow.trainer.finite import NonFiniteError
    from recipes.main_ppo import last_checkpoint_line, report_stop

    _, root = _saved_run(tmp_path, steps=(1, 2))
    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=root, save_freq=1, resume_mode="auto"))
    assert last_checkpoint_line(cfg).endswith(f"is {root}/global_step_2: run the same command again to resume from it")
    with open(os.path.join(ckpt.step_dir(root, 2), "actor", "rank0.pt"), "r+b") as f:
        f.write(b"\x00\x00")  # the checkpoint a resume just failed to load
    assert last_checkpoint_line(cfg) == (f"the run stopped; its last checkpoint {root}/global_step_2 does not verify, "
                                         f"the newest that does is {root}/global_step_1: run again with "
                                         f"trainer.resume_mode={root}/global_step_1 to resume from it")
    assert report_stop(cfg, NonFiniteError("step 3: actor/grad_norm is inf")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "training stopped: step 3: actor/grad_norm is inf" and len(lines) == 2


def test_the_controller_rng_round_trips_through_json(tmp_path):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    np.random.randn()  # numpy's cached gaussian is part of the state
    state = json.loads(json.dumps(ckpt.controller_rng_state()))
    expected = (random.random(), np.random.randn(), torch.rand(3))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt.set_controller_rng_state(state)
    got = (random.random(), np.random.randn(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_metrics_jsonl_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    """The probe: the tracker deleted, the restart cut metrics.jsonl in place; a kill during that
    rewrite must leave the old file whole."""
    import builtins

    from hybridflow import checkpoint_files
    from hybridflow.tracking import jsonl_logger

    logger = jsonl_logger.JsonlLogger(str(tmp_path), "p", "e", {})
    for step in range(1, 8):
        logger.log({"x": float(step)}, step)
    logger.finish()
    before = (tmp_path / "metrics.jsonl").read_text()

    class Killed(BaseException):
        pass

    def killed_writer(file, mode="r", *args, **kwargs):  # a kill once the old content is truncated
        handle = builtins.open(file, mode, *args, **kwargs)
        if "w" in mode:
            handle.close()
            raise Killed
        return handle

    def killed_replace(*args):
        raise Killed

    monkeypatch.setattr(jsonl_logger, "open", killed_writer, raising=False)
    monkeypatch.setattr(checkpoint_files.os, "replace", killed_replace)
    logger = jsonl_logger.JsonlLogger(str(tmp_path), "p", "e", {})
    with pytest.raises(Killed):
        logger.drop_after(3)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
