"""The rollout on a pool of its own (``actor_rollout_ref.hybrid_engine=false``), end to end with the
real recipe on a tiny fp32 model: one trainer slot, one rollout slot.

- Staleness 0 (the pools take turns) is the synchronous run on the same trainer layout: the same
  metrics and final weights, and so is the same run killed with SIGKILL after its step-2
  checkpoint and resumed (nothing is in flight at a checkpoint when the pools take turns).
- One step off policy with partial rollout: every batch after the first was sampled with the
  weights of one step before, the rows say so, the weights move as versioned buckets, and the
  stage timeline shows both pools working at once.
- A rollout or trainer worker that dies stops the run with one clear line, without a hang.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from tests.hybridflow.trainer.recipe_runs import REPO, make_assets, read_steps, recipe_cmd, recipe_env, run_recipe
from tests.hybridflow.trainer.test_resume_recipe import _run_and_kill_after_checkpoint

pytestmark = pytest.mark.slow

ONE_SLOT = "trainer.n_gpus_per_node=1"
TWO_POOLS = ("actor_rollout_ref.hybrid_engine=false", ONE_SLOT, "rollout.n_gpus_per_node=1")
STEPS = ("trainer.total_epochs=2", "trainer.total_training_steps=null", "trainer.save_freq=2", "trainer.test_freq=2")
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "response_length/mean",
            "val/score/mean")


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "hf" / "model.safetensors"))


def _assert_same_steps(got: dict, ref: dict, steps) -> None:
    for step in steps:
        for key in COMPARED:
            if key in ref[step]:
                assert got[step][key] == pytest.approx(ref[step][key], abs=1e-6, rel=0), (step, key)


def test_staleness_0_on_two_pools_is_the_synchronous_run_and_resumes_exactly(tmp_path):
    assets = make_assets(tmp_path, train_size=16)
    sync, pools = tmp_path / "sync", tmp_path / "pools"
    run_recipe(assets, sync, *STEPS, ONE_SLOT)
    ref = read_steps(sync)
    assert len({round(ref[s]["critic/score/mean"], 6) for s in (1, 2, 3, 4)}) > 1  # the comparison can fail

    _run_and_kill_after_checkpoint(assets, pools, *STEPS, *TWO_POOLS, "async_training.staleness_threshold=0",
                                   step=2)
    assert "rollout" in os.listdir(pools / "global_step_2")  # the rollout pool's random state
    proc = run_recipe(assets, pools, *STEPS, *TWO_POOLS, "async_training.staleness_threshold=0")
    assert "resumed from" in proc.stdout + proc.stderr
    got = read_steps(pools)
    assert sorted(s for s in got if s > 0) == [1, 2, 3, 4]
    _assert_same_steps(got, ref, (1, 2, 3, 4))
    for step in (1, 2, 3, 4):
        assert got[step]["async/staleness_max"] == 0.0
        assert got[step]["weight_sync/bytes"] > 0
    final, reference = _weights(pools), _weights(sync)
    assert final.keys() == reference.keys()
    for name in final:
        torch.testing.assert_close(final[name], reference[name], rtol=0, atol=1e-6, msg=name)


def test_one_step_off_with_partial_rollout_overlaps_the_pools(tmp_path):
    assets = make_assets(tmp_path, train_size=16)
    out = tmp_path / "one_step_off"
    run_recipe(assets, out, *TWO_POOLS, "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
               "algorithm.rollout_correction.rollout_is=token", "trainer.total_epochs=2",
               "trainer.timeline=true", "trainer.test_freq=-1")
    got = read_steps(out)
    assert got[1]["async/staleness_max"] == 0.0  # the first batch: the model's own weights
    for step in (2, 3, 4):
        assert got[step]["async/staleness_mean"] == 1.0  # sampled while the step before trained
        assert got[step]["weight_sync/version"] == step
        assert "rollout_corr/rollout_is_mean" in got[step] or any(k.startswith("rollout_corr/") for k in got[step])
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(names[(e["pid"], e["tid"])], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    assert {"main rank 0", "rollout rank 0"} <= set(spans), set(spans)
    generating = [(s, e) for s, e, name in spans["rollout rank 0"] if name.startswith("gen")]
    training = [(s, e) for s, e, name in spans["main rank 0"] if "update" in name or "log_prob" in name]
    assert generating and training, (spans["rollout rank 0"][:5], spans["main rank 0"][:5])
    overlap = sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in generating for b0, b1 in training)
    assert overlap > 0, "the rollout pool never worked while the trainer pool did"


@pytest.mark.parametrize("process, group", [("colocated_rollout", "rollout/rollout"),
                                            ("colocated_actor_rollout_ref", "main/actor_rollout_ref")])
def test_a_dead_worker_of_either_pool_stops_the_run_in_one_line(tmp_path, process, group):
    """The rollout pool generating ahead while the trainer trains: a death on either side fails the
    wait on it; the other pool's pending work does not hold the run."""
    assets = make_assets(tmp_path, train_size=16)
    out = tmp_path / "dies"
    proc = subprocess.Popen(recipe_cmd(assets, out, *TWO_POOLS, "async_training.staleness_threshold=1",
                                       "trainer.total_epochs=100"),
                            cwd=REPO, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        victim = None
        while victim is None:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged"
            if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip():
                victim = next((p for p in psutil.Process(proc.pid).children(recursive=True)
                               if " ".join(p.cmdline()).lower().startswith(f"ray::{process}")), None)
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=180)  # no hang: the controller's wait fails on the dead actor
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert f"{group}: rank 0 died during" in err, err[-3000:]
