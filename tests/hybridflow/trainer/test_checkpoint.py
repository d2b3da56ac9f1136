"""Checkpoint folders without Ray: tracker and manifest rules, damaged folders, pruning, and the
PPOTrainer's save/resume bookkeeping with stand-in worker groups (the real engines and the
SIGKILL round trip are in test_resume_recipe.py)."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.trainer import checkpoint as ckpt


def _complete_folder(root, step, layout=None):
    path = ckpt.step_dir(str(root), step)
    os.makedirs(os.path.join(path, "actor"))
    with open(os.path.join(path, "actor", "shard0.bin"), "wb") as f:
        f.write(b"x" * 100)
    torch.save({"global_step": step}, os.path.join(path, ckpt.TRAINER_STATE))
    ckpt.write_manifest(path, step, layout or {"actor_rollout_ref": {"world_size": 2}})
    ckpt.write_tracker(str(root), step)
    return path


def test_tracker_names_the_complete_folder_and_leaves_no_temp_file(tmp_path):
    path = _complete_folder(tmp_path, 4)
    assert ckpt.find_resume_dir(str(tmp_path), "auto") == path
    assert ckpt.read_tracker(str(tmp_path)) == 4
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert ckpt.find_resume_dir(str(tmp_path), "disable") is None
    assert ckpt.find_resume_dir(str(tmp_path / "empty"), "auto") is None  # a fresh run


def test_resume_path_may_name_the_run_folder(tmp_path):
    """verl users pass resume_from_path=<the run's folder>: its latest checkpoint, not an error
    about a missing manifest."""
    _complete_folder(tmp_path / "run", 2)
    latest = _complete_folder(tmp_path / "run", 4)
    assert ckpt.find_resume_dir(str(tmp_path / "elsewhere"), str(tmp_path / "run")) == latest


def test_garbage_tracker_is_a_clear_error(tmp_path):
    _complete_folder(tmp_path, 2)
    (tmp_path / ckpt.TRACKER).write_text("\x00\x17garbage")
    with pytest.raises(ckpt.CheckpointError, match="corrupted.*trainer.resume_mode"):
        ckpt.find_resume_dir(str(tmp_path), "auto")


def test_tracker_pointing_at_a_missing_folder_is_a_clear_error(tmp_path):
    _complete_folder(tmp_path, 2)
    ckpt.write_tracker(str(tmp_path), 6)
    with pytest.raises(ckpt.CheckpointError, match="global_step_6 does not exist"):
        ckpt.find_resume_dir(str(tmp_path), "auto")


def test_save_interrupted_before_the_manifest_is_refused(tmp_path):
    path = _complete_folder(tmp_path, 2)
    os.remove(os.path.join(path, ckpt.MANIFEST))
    with pytest.raises(ckpt.CheckpointError, match="incomplete.*did not finish"):
        ckpt.find_resume_dir(str(tmp_path), path)


@pytest.mark.parametrize("damage", ["delete", "truncate", "bad_manifest"])
def test_damaged_folder_is_refused_naming_the_file(tmp_path, damage):
    path = _complete_folder(tmp_path, 2)
    shard = os.path.join(path, "actor", "shard0.bin")
    if damage == "delete":
        os.remove(shard)
    elif damage == "truncate":
        with open(shard, "wb") as f:
            f.write(b"x" * 10)
    else:
        with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
            f.write("{not json")
    expected = "unreadable" if damage == "bad_manifest" else r"damaged.*actor/shard0\.bin"
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.find_resume_dir(str(tmp_path), "auto")


def test_prune_keeps_the_newest_and_never_the_tracked_one(tmp_path):
    for step in (2, 4, 6, 8):
        _complete_folder(tmp_path, step)
    assert ckpt.prune(str(tmp_path), 2) == [2, 4]
    assert sorted(os.listdir(tmp_path)) == ["global_step_6", "global_step_8", ckpt.TRACKER]
    ckpt.write_tracker(str(tmp_path), 6)  # e.g. resumed from an older folder
    os.makedirs(ckpt.step_dir(str(tmp_path), 10))
    assert ckpt.prune(str(tmp_path), 1) == [8]
    assert ckpt.prune(str(tmp_path), None) == []


@pytest.mark.parametrize("actor, critic, has_critic, kept", [
    (None, None, True, None), (3, None, True, 3), (None, 2, True, 2), (3, 2, True, 2), (2, 3, True, 2),
    (3, 2, False, 3), (None, 2, False, None)])
def test_one_folder_holds_both_roles_so_the_smaller_limit_wins(actor, critic, has_critic, kept):
    assert ckpt.folders_to_keep(actor, critic, has_critic) == kept


def test_checkpoint_limits_must_be_null_or_positive():
    from hybridflow.config import load_config
    from hybridflow.config.ranges import range_errors
    from recipes.cli import compose_config

    cfg = load_config(compose_config("ppo", ["trainer.max_critic_ckpt_to_keep=0", "trainer.max_actor_ckpt_to_keep=0"]))
    assert [e for e in range_errors(cfg) if "ckpt_to_keep" in e] == [
        "trainer.max_actor_ckpt_to_keep=0 must be null or a positive integer",
        "trainer.max_critic_ckpt_to_keep=0 must be null or a positive integer"]


# ---------------------------------------------------------------------- the trainer's side
class FakeGroup:
    """Stands in for a worker group: one file per rank, records the folders it loads."""

    def __init__(self, world_size):
        self.world_size, self.loaded = world_size, []

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        for rank in range(self.world_size):
            torch.save({"rank": rank}, os.path.join(path, f"rank{rank}.pt"))

    def load_checkpoint(self, path):
        self.loaded.append(path)


def _trainer(tmp_path, world_size, *overrides):
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.cli import compose_config

    cfg = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path / 'run'}",
                                              f"trainer.n_gpus_per_node={world_size}", *overrides]))
    loader = ResumablePromptLoader(list(range(24)), 8, seed=3, collate_fn=list)
    return PPOTrainer(cfg, {"actor_rollout_ref": FakeGroup(world_size)}, None, loader, None, None, None,
                      progress=False)


def test_trainer_round_trip_restores_step_loader_kl_and_rng(tmp_path):
    trainer = _trainer(tmp_path, 2, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1",
                       "algorithm.kl_ctrl.horizon=100", "trainer.max_actor_ckpt_to_keep=1")
    for step in (1, 2):
        trainer.train_loader.next_batch()
        trainer.global_step = step
        trainer.kl_ctrl.update(0.5, 8)
        path = trainer.save_checkpoint()
    assert sorted(os.listdir(tmp_path / "run")) == ["global_step_2", ckpt.TRACKER]  # step 1 pruned
    manifest = json.loads(open(os.path.join(path, ckpt.MANIFEST)).read())
    assert manifest["layout"]["actor_rollout_ref"]["world_size"] == 2
    assert {"actor/rank0.pt", "actor/rank1.pt", ckpt.TRAINER_STATE} <= set(manifest["files"])
    expected = (trainer.train_loader.next_batch(), trainer.kl_ctrl.value, random.random(), np.random.rand(),
                torch.rand(3))

    fresh = _trainer(tmp_path, 2, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1",
                     "algorithm.kl_ctrl.horizon=100")
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    fresh._maybe_resume()
    assert fresh.global_step == 2 and fresh.actor.loaded == [os.path.join(path, "actor")]
    got = (fresh.train_loader.next_batch(), fresh.kl_ctrl.value, random.random(), np.random.rand(), torch.rand(3))
    assert got[:4] == expected[:4] and torch.equal(got[4], expected[4])


def test_trainer_keeps_as_many_folders_as_the_critic_limit_when_it_trains_a_critic(tmp_path):
    for groups, kept in (({"critic": FakeGroup(2)}, ["global_step_3"]), ({}, ["global_step_2", "global_step_3"])):
        trainer = _trainer(tmp_path / str(len(groups)), 2, "trainer.max_actor_ckpt_to_keep=2",
                           "trainer.max_critic_ckpt_to_keep=1")
        trainer.critic = groups.get("critic")
        for step in (1, 2, 3):
            trainer.global_step = step
            trainer.save_checkpoint()
        assert sorted(d for d in os.listdir(tmp_path / str(len(groups)) / "run") if d != ckpt.TRACKER) == kept


def test_trainer_refuses_a_checkpoint_of_another_worker_count_before_loading(tmp_path):
    trainer = _trainer(tmp_path, 2)
    trainer.global_step = 2
    trainer.save_checkpoint()
    other = _trainer(tmp_path, 1)
    with pytest.raises(ckpt.CheckpointError, match=r"world_size: saved 2, now 1.*n_gpus_per_node"):
        other._maybe_resume()
    assert other.actor.loaded == [] and other.global_step == 0


def test_a_mismatched_or_foreign_checkpoint_is_refused_from_the_config_alone(tmp_path):
    """The recipes check the checkpoint they would resume from before Ray starts (exit 2, one
    line): the layout comes from the config, not from running workers."""
    from hybridflow.config import load_config
    from hybridflow.config.sft import load_sft_config
    from hybridflow.trainer.sft_trainer import sft_worker_layout
    from recipes.cli import compose_config
    from recipes.main_ppo import INPUT_ERRORS, read_inputs

    trainer = _trainer(tmp_path, 2)
    trainer.global_step = 2
    trainer.save_checkpoint()
    run = tmp_path / "run"
    one = load_config(compose_config("grpo", [f"trainer.default_local_dir={run}", "trainer.n_gpus_per_node=1"]))
    with pytest.raises(ckpt.CheckpointError, match="world_size: saved 2, now 1"):
        read_inputs(one)  # first thing it checks, before the tokenizer and the data files
    assert INPUT_ERRORS[ckpt.CheckpointError] == "checkpoint error"
    sft = load_sft_config(compose_config("sft", [f"trainer.default_local_dir={run}", "trainer.resume_mode=auto"]))
    with pytest.raises(ckpt.CheckpointError, match=r"saved by another recipe \(roles \['actor_rollout_ref'\]"):
        ckpt.open_resume(str(run), "auto", sft_worker_layout(sft))


def test_a_lora_checkpoint_resumes_only_with_its_lora_settings():
    """The saved tensors are a base model plus rank-r adapters scaled by alpha/r on load: resumed
    without LoRA the optimizer state failed to load deep in a worker; with another alpha the
    model silently changed (validation 0.44 -> 0.0). Both are refused from the config alone."""
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import worker_layout
    from recipes.cli import compose_config

    def layout(*overrides):
        return worker_layout(load_config(compose_config("grpo", list(overrides))))

    saved = layout("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    ckpt.check_layout("ckpt", saved, layout("actor_rollout_ref.model.lora_rank=4",
                                            "actor_rollout_ref.model.lora_alpha=8"))
    with pytest.raises(ckpt.CheckpointError, match=r"actor_rollout_ref.lora_alpha: saved 8.0, now 2000.0.*LoRA keys"):
        ckpt.check_layout("ckpt", saved, layout("actor_rollout_ref.model.lora_rank=4",
                                                "actor_rollout_ref.model.lora_alpha=2000"))
    with pytest.raises(ckpt.CheckpointError, match=r"actor_rollout_ref.lora_rank: saved 4, now None"):
        ckpt.check_layout("ckpt", saved, layout())
    assert "lora_rank" not in layout()["actor_rollout_ref"]  # layouts without LoRA are as before
