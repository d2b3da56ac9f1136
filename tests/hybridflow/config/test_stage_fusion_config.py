"""``stage_fusion`` (hybridflow/config/stage_fusion.py): off by default, and what it cannot run on
is refused before any worker starts, in one line naming the key and the fix."""
import pytest

from hybridflow.config import load_config, validate
from tests.hybridflow.config.validate_helpers import error_of, grpo

MEGATRON_PP2 = {"strategy": "megatron", "megatron": {"pipeline_model_parallel_size": 2}}


def test_off_by_default():
    sf = load_config({}).stage_fusion
    assert (sf.enable, sf.fuse_actor_critic_update, sf.migrate_below, sf.migrate_to) == (False, False, 0.25, 1)


def test_streaming_runs_on_the_hybrid_engine_with_vllm():
    validate(grpo(stage_fusion__enable=True), check_paths=False)
    msg = error_of(grpo(stage_fusion__enable=True, actor_rollout_ref__rollout__name="hf"), check_paths=False)
    assert "stage_fusion.enable=true" in msg and "rollout.name=vllm" in msg, msg
    msg = error_of(grpo(stage_fusion__enable=True, actor_rollout_ref__hybrid_engine=False, trainer__n_gpus_per_node=1),
                   check_paths=False)
    assert "hybrid_engine=false" in msg and "use one of the two" in msg, msg


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_migrate_below_is_a_fraction(value):
    msg = error_of(grpo(stage_fusion__migrate_below=value), check_paths=False)
    assert "stage_fusion.migrate_below" in msg and "[0, 1]" in msg, msg


def test_the_fused_update_needs_a_critic_and_one_megatron_pipeline():
    msg = error_of(grpo(stage_fusion__fuse_actor_critic_update=True), check_paths=False)
    assert "has no critic" in msg, msg
    ppo = dict(algorithm__adv_estimator="gae", actor_rollout_ref__rollout__n=1, stage_fusion__fuse_actor_critic_update=True)
    msg = error_of(grpo(**ppo), check_paths=False)
    assert "set both strategies to megatron" in msg, msg
    both = dict(ppo, actor_rollout_ref__actor__strategy="megatron", critic__strategy="megatron")
    msg = error_of(grpo(**both), check_paths=False)
    assert "pipeline of 2 or more stages" in msg, msg
    arr_pp2 = {"actor_rollout_ref__actor__megatron__pipeline_model_parallel_size": 2}
    validate(grpo(**both, **arr_pp2, critic__megatron__pipeline_model_parallel_size=2), check_paths=False)
    msg = error_of(grpo(**both, **arr_pp2, critic__megatron__pipeline_model_parallel_size=2,
                        trainer__placement="separate"), check_paths=False)
    assert "trainer.placement=colocate" in msg, msg
