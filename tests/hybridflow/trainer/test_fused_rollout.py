"""Stage fusion (``stage_fusion.enable``, hybridflow/trainer/fused_rollout.py) end to end with the
real recipe on a tiny fp32 model, two colocated slots: PPO with a critic, a reference and old
log-probs (two mini-batches), greedy, with every sample moved off one rollout rank after its
first engine step (``migrate_below=1``, one-step slices), so the moved tail, the freed rank's
inference and the streamed reward all run. The fused step must be the unfused one: the same
tokens and scores (the rollout dump), the same losses, values and KL, the same final weights.
With the reference and the critic on a pool of their own (placement=separate), each chunk goes to
that pool as it arrives: the same tokens, scores and first step.
"""
from __future__ import annotations

import pytest
import torch

from tests.hybridflow.trainer.recipe_runs import make_assets, read_steps, run_recipe

pytestmark = pytest.mark.slow

PPO_GREEDY = ("algorithm.adv_estimator=gae", "critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=1",
              "actor_rollout_ref.rollout.do_sample=false", "data.max_response_length=12",
              "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1")
FUSED = ("stage_fusion.enable=true", "stage_fusion.migrate_below=1.0", "stage_fusion.slice_s=0.0001",
         "stage_fusion.min_chunk=1")
SEPARATE = ("trainer.placement=separate", "trainer.separate_pool_gpus_per_node=1", "trainer.cpus_per_worker=0.5")
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl",
            "critic/vf_loss", "critic/values/mean", "critic/advantages/mean", "response_length/mean")


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "hf" / "model.safetensors"))


def _dump(folder) -> list[str]:
    return sorted(line for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines())


def test_greedy_fused_step_equals_the_unfused_step(tmp_path):
    assets = make_assets(tmp_path, train_size=16)
    runs = {}
    for name, extra in (("unfused", ()), ("fused", FUSED), ("fused_separate", FUSED + SEPARATE)):
        out = tmp_path / name
        run_recipe(assets, out, *PPO_GREEDY, f"trainer.rollout_data_dir={out / 'rollouts'}", *extra)
        runs[name] = out
    ref = read_steps(runs["unfused"])
    assert "fusion/migrated_samples" not in ref[1]
    for name in ("fused", "fused_separate"):
        got = read_steps(runs[name])
        assert any(got[s].get("fusion/migrated_samples", 0) > 0 for s in (1, 2)), name  # the tail did move
        assert any(got[s].get("fusion/rows_inferred_during_gen", 0) > 0 for s in (1, 2)), name  # on the freed rank
        # tokens and scores of both steps: step 2 samples from the actor step 1 trained
        assert _dump(runs[name] / "rollouts") == _dump(runs["unfused"] / "rollouts"), name
        for step in (1, 2):
            # the trainer's log-probs of the tokens vLLM chose, as unfused
            assert got[step]["training/rollout_probs_diff_max"] < 1e-3, (name, step)
        # a critic on a pool of its own takes other mini-batches (rows are dealt by data-parallel
        # rank), so from its first update on, its numbers are the placement's, not fusion's
        steps, keys = ((1, 2), COMPARED) if name == "fused" else ((1,), [k for k in COMPARED if k != "critic/vf_loss"])
        for step in steps:
            for key in keys:
                if key in ref[step]:
                    assert got[step][key] == pytest.approx(ref[step][key], abs=1e-5, rel=1e-5), (name, step, key)
    want, have = _weights(runs["unfused"]), _weights(runs["fused"])
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-6, rtol=0, msg=name)
