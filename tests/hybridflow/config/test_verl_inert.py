"""verl keys with no effect here: accepted at their listed values, rejected with the reason
otherwise, and never shadowing a key the schema has."""
import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.load import dotted_keys
from hybridflow.config.root import RootConfig
from hybridflow.verl_compat import ANY, INERT_KEYS
from recipes.cli import compose_config


def _hydra_value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def test_no_inert_key_is_a_schema_key():
    overlap = set(INERT_KEYS) & set(dotted_keys(RootConfig))
    assert not overlap, f"these keys are read by the code, so they are not inert: {overlap}"


def test_every_inert_key_is_accepted_at_its_values_and_changes_nothing():
    plain = load_config(compose_config("grpo"))
    overrides = [f"{key}={_hydra_value(7 if accepted is ANY else accepted[0])}"
                 for key, (accepted, _) in INERT_KEYS.items()]
    assert load_config(compose_config("grpo", overrides)) == plain
    # with Hydra's '+' too, and inside a config tree (a verl YAML), emptied sections pruned
    assert load_config(compose_config("grpo", ["+" + overrides[0]])) == plain
    tree = {"data": {"custom_cls": {"path": None, "name": None}}, "global_profiler": {"tool": None, "steps": None},
            "actor_rollout_ref": {"actor": {"fsdp_config": {"wrap_policy": {"min_num_params": 0}}}}}
    assert load_config(tree) == load_config({})


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.megatron.context_parallel_size=2",
     "actor_rollout_ref.actor.megatron.context_parallel_size=2: context parallelism is not implemented; set it to 1"),
    ("data.custom_cls.path=/data/my_dataset.py", "data.custom_cls.path='/data/my_dataset.py': a custom dataset class"),
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=/x.yaml",
     "multi_turn.interaction_config_path='/x.yaml': simulated-user interactions are not implemented"),
    ("critic.model.fsdp_config.model_dtype=bf16", "critic.model.fsdp_config.model_dtype='bf16': the FSDP model holds"),
    ("reward_model.model.trust_remote_code=true", "reward_model.model.trust_remote_code=true: remote model code is "
                                                  "never run; set it to false"),
])
def test_a_value_that_asks_for_a_missing_feature_fails_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(compose_config("grpo", [override, "algorithm.use_pf_ppo=false"]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_accepted_key_beside_a_typo_is_not_reported():
    with pytest.raises(ConfigError) as err:
        compose_config("grpo", ["actor_rollout_ref.rollout.layered_summon=true", "data.bogus_key=1"])
    assert str(err.value).startswith("unknown config key 'data.bogus_key'") and "layered_summon" not in str(err.value)
