"""The fused actor-critic update (``stage_fusion.fuse_actor_critic_update``; workers/fused_update.py)
end to end with the real recipe on a tiny fp32 model: PPO with a critic, both on Megatron pipeline
2 over the 2 colocated slots, the critic's pipeline reversed by the recipe. It must be the run that
updates the critic and then the actor: the same losses, values and final weights."""
from __future__ import annotations

import pytest
import torch

from tests.hybridflow.trainer.recipe_runs import make_assets, read_steps, run_recipe

pytestmark = pytest.mark.slow

PPO_PP2 = ("algorithm.adv_estimator=gae", "critic.enable=true", "actor_rollout_ref.rollout.n=1",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
           "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.strategy=megatron",
           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "critic.strategy=megatron",
           "critic.megatron.pipeline_model_parallel_size=2", "trainer.total_training_steps=2",
           "trainer.test_freq=-1", "trainer.save_freq=-1")
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm",
            "critic/vf_loss", "critic/values/mean", "critic/grad_norm", "response_length/mean")


def test_fused_update_is_the_critic_update_then_the_actor_update(tmp_path):
    from safetensors.torch import load_file

    assets = make_assets(tmp_path, train_size=16)
    runs = {}
    for name, extra in (("apart", ()), ("fused", ("stage_fusion.fuse_actor_critic_update=true",))):
        runs[name] = tmp_path / name
        run_recipe(assets, runs[name], *PPO_PP2, *extra)
    ref, got = read_steps(runs["apart"]), read_steps(runs["fused"])
    for step in (1, 2):
        assert "timing_s/update_actor_critic" in got[step] and "timing_s/update_actor" not in got[step]
        for key in COMPARED:
            if key in ref[step]:
                assert got[step][key] == pytest.approx(ref[step][key], abs=1e-6, rel=1e-6), (step, key)
    want, have = (load_file(str(runs[n] / "hf" / "model.safetensors")) for n in ("apart", "fused"))
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-6, rtol=0, msg=name)
