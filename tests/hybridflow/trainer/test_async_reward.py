"""reward_model.launch_reward_fn_async: the reward function scores in a Ray process of its own
while the step goes on, on that process's main thread (signal-based timeouts work), and its
scores land on the right rows after the batch was reordered."""
from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from hybridflow.rewards.loader import RewardFunctionError
from hybridflow.rewards.manager import make_reward_manager
from hybridflow.tiny import make_char_tokenizer
from hybridflow.trainer.generations import RESPONSE_TEXT, take_carried
from tests.hybridflow.trainer.test_dynamic_sampling import PROMPT, FakeActor

DIGIT0 = 3  # the char tokenizer's id of "0"

REWARD_FN = textwrap.dedent("""
    import os, signal, threading, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        signal.alarm(5)  # as math_verify's timeouts do: only allowed on a main thread
        signal.alarm(0)
        time.sleep(0.3 if ground_truth == "slow" else 0.05)  # a slow scorer
        if ground_truth == "raise":
            raise ValueError("no answer found")
        return {"score": 10 * int(solution_str[0]) + int(solution_str[1]), "pid": os.getpid(),
                "main_thread": threading.current_thread() is threading.main_thread()}
""")


class SampleNumberingActor(FakeActor):
    """Response = (the prompt's digit, the sample's digit): every row decodes to its own text."""

    def generate_sequences(self, gen_in):
        out = super().generate_sequences(gen_in)
        n = gen_in.meta_info["n"]
        out.batch["responses"][:, 1] = DIGIT0 + torch.arange(len(out)) % n
        return out


def _trainer(tmp_path, ground_truth="y", *overrides, timeout_s=None):
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.cli import compose_config

    (tmp_path / "reward.py").write_text(REWARD_FN)
    cfg = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2",
                                              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                                              f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", *overrides]))
    rows = [{"input_ids": torch.full((PROMPT,), DIGIT0 + i), "attention_mask": torch.ones(PROMPT, dtype=torch.long),
             "position_ids": torch.arange(PROMPT), "data_source": "x", "ground_truth": ground_truth}
            for i in range(4)]
    reward = make_reward_manager(str(tmp_path / "reward.py"), timeout_s=timeout_s)
    return PPOTrainer(cfg, {"actor_rollout_ref": SampleNumberingActor()}, make_char_tokenizer(),
                      ResumablePromptLoader(rows, 4, shuffle=False), None, reward, None, progress=False)


def test_scores_come_from_the_reward_process_and_follow_the_reordered_rows(tmp_path, ray_cluster):
    trainer = _trainer(tmp_path, "slow", "reward_model.launch_reward_fn_async=true")
    try:
        batch = DataProto.from_single_dict(trainer.train_loader.next_batch())
        started = time.perf_counter()
        batch, _, _, pending = trainer._rollout(batch, metrics := {})
        # scoring takes 8 x 0.3 s: the step did not wait for it (a wide margin, as the suite runs
        # two files at a time on 2 cores)
        assert time.perf_counter() - started < 1.2 and not pending.done()
        assert "token_level_scores" not in batch.batch.keys()
        order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])  # what balance_batch may do meanwhile
        batch = batch.reorder(order)
        trainer._apply_scores(batch, pending.result(), metrics, order)
    finally:
        trainer.close()
    expected = torch.tensor([10 * (r // 2) + r % 2 for r in order.tolist()], dtype=torch.float32)
    assert torch.equal(batch.batch["token_level_scores"][:, -1], expected)
    assert metrics["reward/errors"] == 0.0 and metrics["reward/main_thread/mean"] == 1.0
    carried = take_carried(batch)
    assert list(carried["texts"]) == [f"{r // 2}{r % 2}" for r in order.tolist()]
    pids = {e["pid"] for e in carried["extras"]}
    assert len(pids) == 1 and os.getpid() not in pids  # one process of its own, not the driver
    assert RESPONSE_TEXT not in batch.non_tensor_batch


def test_a_function_that_raises_everywhere_stops_the_step_with_the_inline_error(tmp_path, ray_cluster):
    trainer = _trainer(tmp_path, "raise", "reward_model.launch_reward_fn_async=true")
    try:
        _, _, _, pending = trainer._rollout(DataProto.from_single_dict(trainer.train_loader.next_batch()), {})
        with pytest.raises(RewardFunctionError, match="raised on all 8 samples.*ValueError: no answer found"):
            pending.result()
    finally:
        trainer.close()


def test_without_the_key_or_with_dynamic_sampling_the_scores_are_on_the_batch_at_once(tmp_path):
    for overrides in ([], ["reward_model.launch_reward_fn_async=true", "algorithm.filter_groups.enable=true"]):
        trainer = _trainer(tmp_path, "y", *overrides)
        assert trainer.reward_process is None
        batch, _, _, pending = trainer._rollout(DataProto.from_single_dict(trainer.train_loader.next_batch()), {})
        assert pending is None
        assert batch.batch["token_level_scores"][:, -1].tolist() == [0, 1, 10, 11, 20, 21, 30, 31]
        assert {e["pid"] for e in take_carried(batch)["extras"]} == {os.getpid()}  # scored by the driver


def _ended(proc) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # killed; its parent (or init) has yet to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("in_reward_process", [False, True], ids=["inline", "reward_process"])
def test_close_ends_the_reward_functions_child_process(tmp_path, request, in_reward_process):
    """custom_reward_function.timeout_s scores in a child process; close() (the recipe's finally)
    stops it at once: before, it ran on until its pipe closed or its watcher saw its parent gone."""
    import psutil

    if in_reward_process:
        request.getfixturevalue("ray_cluster")
    overrides = ["reward_model.launch_reward_fn_async=true"] if in_reward_process else []
    trainer = _trainer(tmp_path, "y", *overrides, timeout_s=30)
    try:
        batch, _, _, pending = trainer._rollout(DataProto.from_single_dict(trainer.train_loader.next_batch()), {})
        if pending is not None:
            trainer._apply_scores(batch, pending.result(), {})
        pids = {e["pid"] for e in take_carried(batch)["extras"]}
        assert len(pids) == 1 and os.getpid() not in pids  # scored in a child, not in the driver
        child = psutil.Process(pids.pop())
        assert not _ended(child) and (child.ppid() == os.getpid()) != in_reward_process
    finally:
        trainer.close()
    assert _ended(child)
