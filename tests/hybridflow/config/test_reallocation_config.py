"""``actor_rollout_ref.rollout.reallocation`` (hybridflow/config/reallocation.py): off by default,
its threshold a fraction strictly between 0 and 1, and what it cannot run on refused before any
worker starts, in one line naming the key and the fix."""
import pytest

from hybridflow.config import load_config, validate
from tests.hybridflow.config.validate_helpers import error_of, grpo

ON = dict(actor_rollout_ref__rollout__reallocation__enable=True)


def test_off_by_default():
    r = load_config({}).actor_rollout_ref.rollout.reallocation
    assert (r.enable, r.threshold, r.slice_s, r.deal_by_length) == (False, 0.25, 0.1, True)


def test_runs_on_the_hybrid_engine_with_vllm():
    validate(grpo(**ON), check_paths=False)
    msg = error_of(grpo(**ON, actor_rollout_ref__rollout__name="hf"), check_paths=False)
    assert "reallocation.enable=true" in msg and "rollout.name=vllm" in msg, msg
    msg = error_of(grpo(**ON, actor_rollout_ref__hybrid_engine=False, trainer__n_gpus_per_node=1), check_paths=False)
    assert "reallocation.enable=true" in msg and "hybrid_engine=false" in msg and "use one of the two" in msg, msg


def test_not_with_stage_fusion():
    msg = error_of(grpo(**ON, stage_fusion__enable=True), check_paths=False)
    assert "reallocation.enable=true" in msg and "stage_fusion.enable=true" in msg and "set one of the two" in msg, msg
    validate(grpo(stage_fusion__enable=True), check_paths=False)  # fusion alone is fine


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5])
def test_threshold_is_a_fraction(value):
    msg = error_of(grpo(actor_rollout_ref__rollout__reallocation__threshold=value), check_paths=False)
    assert "reallocation.threshold" in msg and "(0, 1)" in msg, msg


def test_slice_is_positive():
    msg = error_of(grpo(actor_rollout_ref__rollout__reallocation__slice_s=0), check_paths=False)
    assert "reallocation.slice_s" in msg and "> 0" in msg, msg


def test_adopted_first_builds_the_engines_with_vllms_priority_policy():
    from recipes.engine_settings import rollout_engine_kwargs

    def policy(**kw):
        return rollout_engine_kwargs(grpo(**kw))["vllm_engine_kwargs"].get("scheduling_policy")

    assert load_config({}).actor_rollout_ref.rollout.reallocation.adopted_first
    assert policy(**ON) == "priority"
    assert policy() is None  # reallocation off: vLLM's default (first come, first served)
    assert policy(**ON, actor_rollout_ref__rollout__reallocation__adopted_first=False) is None
    fcfs = dict(actor_rollout_ref__rollout__engine_kwargs__vllm={"scheduling_policy": "fcfs"})
    msg = error_of(grpo(**ON, **fcfs), check_paths=False)
    assert "reallocation.adopted_first=true" in msg and "scheduling_policy=fcfs" in msg and "adopted_first=false" in msg, msg
    validate(grpo(**ON, **fcfs, actor_rollout_ref__rollout__reallocation__adopted_first=False), check_paths=False)
