"""Exact resume of a real ``recipes.main_ppo`` GRPO run after SIGKILL, at an epoch boundary.

The data set holds 16 prompts and a step takes 8, so one epoch is 2 steps: the step-2
checkpoint lies exactly on the epoch boundary (the trap: a resumed run that thinks epoch 1 is
over and epoch 2 has not started must still train epoch 2's steps). An uninterrupted 4-step run
is the reference; a second identical run is killed with SIGKILL (its whole process group, Ray
included) as soon as its step-2 checkpoint is complete, then started again with the same
command and resumes by itself (``trainer.resume_mode=auto``). Steps 3-4 must match the
reference to 1e-6 in fp32: same data order, same sampled responses (the generation RNG is part
of the checkpoint), same optimizer state. The reference scores in the async reward process
(``reward_model.launch_reward_fn_async``) and the other runs inline, so the match also shows the
overlap changes nothing, down to the rows of the rollout dumps. The killed and resumed runs also
log to TensorBoard and MLflow, which must hold one curve and one run across the two processes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from hybridflow.trainer.checkpoint import TRACKER
from tests.hybridflow.trainer.recipe_runs import REPO, make_assets, read_steps, recipe_cmd, recipe_env, run_recipe

pytestmark = pytest.mark.slow

STEPS = ["trainer.total_epochs=2", "trainer.total_training_steps=null", "trainer.save_freq=2",
         "trainer.test_freq=2", "trainer.rollout_data_dir=${trainer.default_local_dir}/rollouts",
         # verl's hf_model: every checkpoint also holds the actor as an HF checkpoint (resume ignores it)
         "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
# jsonl first: the kill lands right after the step-2 checkpoint, before or after its step is logged
LOGGERS = "trainer.logger=[jsonl,console,tensorboard,mlflow]"
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "response_length/mean", "val/score/mean")


def _run_and_kill_after_checkpoint(assets, out_dir, *extra: str, step: int, timeout: float = 400) -> None:
    """Start the recipe in its own session; SIGKILL every process of it once the tracker names
    ``step`` (the tracker is written last, so the checkpoint is complete by then)."""
    proc = subprocess.Popen(recipe_cmd(assets, out_dir, *STEPS, *extra), cwd=REPO, env=recipe_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    tracker = out_dir / TRACKER
    deadline = time.monotonic() + timeout
    try:
        while not (tracker.exists() and tracker.read_text().strip() == str(step)):
            if proc.poll() is not None:
                pytest.fail(f"run ended (rc {proc.returncode}) before its step-{step} checkpoint:\n"
                            f"{proc.stderr.read()[-5000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no step-{step} checkpoint after {timeout} s")
            time.sleep(0.1)
    finally:
        family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        # a user's kill -9 hits the driver alone: its Ray instance (head, agents, workers) must not
        # outlive it (hybridflow/ray_watchdog.py); the group kill below only tidies up after a failure
        proc.kill()
        proc.wait()
        ray_left = _running_after([p for p in family if _is_ray(p)], timeout=30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the recipe, its Ray head and the worker actors
        except ProcessLookupError:  # nothing of the group left
            pass
        for child in family:  # any that left the process group
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not ray_left, f"Ray processes outlived the killed run: {[p.pid for p in ray_left]}"


def _is_ray(process: psutil.Process) -> bool:
    try:
        return "ray" in " ".join(process.cmdline()).lower()
    except psutil.Error:  # gone already
        return False


def _running_after(processes: list, timeout: float) -> list:
    """Those of ``processes`` still running after ``timeout`` s (a zombie waiting for a parent
    that does not reap it has stopped running)."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    running.append(p)
            except psutil.Error:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def test_sigkilled_run_resumes_exactly_at_epoch_boundary(tmp_path):
    assets = make_assets(tmp_path, train_size=16)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_recipe(assets, reference, *STEPS, "reward_model.launch_reward_fn_async=true")
    ref = read_steps(reference)
    assert sorted(s for s in ref if s > 0) == [1, 2, 3, 4]
    assert [ref[s]["training/epoch"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]

    # the step-4 checkpoint's HF copy is the run's final model, tensor for tensor
    from safetensors.torch import load_file
    in_checkpoint = load_file(str(reference / "global_step_4" / "actor" / "huggingface" / "model.safetensors"))
    final = load_file(str(reference / "hf" / "model.safetensors"))
    assert in_checkpoint.keys() == final.keys() and all(torch.equal(in_checkpoint[k], final[k]) for k in final)

    _run_and_kill_after_checkpoint(assets, resumed, LOGGERS, step=2)
    assert not (resumed / "global_step_4").exists()
    assert {"manifest.json", "trainer_state.json", "actor"} <= set(os.listdir(resumed / "global_step_2"))
    # and its tracker is lost too (before, resume_mode=auto then restarted from step 0 over the
    # checkpoints and cut metrics.jsonl): it must find its newest checkpoint that verifies
    os.remove(resumed / TRACKER)
    proc = run_recipe(assets, resumed, *STEPS, LOGGERS)
    assert f"has no {TRACKER}: resuming from the newest checkpoint that verifies, {resumed}/global_step_2" \
        in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    got = read_steps(resumed)
    assert sorted(s for s in got if s > 0) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step]["training/epoch"] == 1
        for key in COMPARED:
            if key not in ref[step]:  # validation runs on steps 2 and 4 only
                assert key not in got[step]
                continue
            assert got[step][key] == pytest.approx(ref[step][key], abs=1e-6, rel=0), (step, key)
    for step in (3, 4):  # the same responses, scores and reward fields, row for row
        assert (resumed / "rollouts" / f"{step}.jsonl").read_text() == (reference / "rollouts" / f"{step}.jsonl").read_text()
    _assert_one_curve_and_one_run(resumed, {s: got[s]["critic/score/mean"] for s in (3, 4)})
    # the reference's scores are not constant, so the comparison above can tell runs apart
    assert len({round(ref[s]["critic/score/mean"], 6) for s in (1, 2, 3, 4)}) > 1


def _assert_one_curve_and_one_run(out_dir, resumed_scores: dict[int, float]) -> None:
    """TensorBoard shows each step once and MLflow holds one run, with the resumed steps' scores."""
    import json

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    curve = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item())
             for e in events.Tensors("critic/score/mean")]
    assert [s for s, _ in curve] == sorted({s for s, _ in curve}), curve
    client = MlflowClient(tracking_uri=f"sqlite:///{out_dir}/mlruns/mlflow.db")
    run = client.get_run(json.loads((out_dir / "mlflow_run.json").read_text())["run_id"])
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    assert run.data.tags["resumed_after_step"] == "2" and run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "critic/score/mean"), key=lambda m: m.timestamp)
    latest = {m.step: m.value for m in history}
    for step, score in resumed_scores.items():
        assert dict(curve)[step] == pytest.approx(score, abs=1e-6), (step, curve)
        assert latest[step] == pytest.approx(score, abs=1e-6), (step, latest)
