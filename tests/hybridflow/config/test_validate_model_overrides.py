"""The checks of ``model.override_config`` and ``model.external_lib``: keys the model's config lacks,
values that would change weight shapes or that transformers refuses, lengths the override extends, and
a module that registers a model class before its config is read."""
import json

import pytest

from hybridflow.config import validate
from tests.hybridflow.config.validate_helpers import TINY_MODEL, error_of, grpo, run_dir  # noqa: F401  (a fixture)

OVERRIDE = "actor_rollout_ref.model.override_config"


def test_override_config_keys_must_be_attributes_of_the_models_config(run_dir):
    msg = error_of(grpo(actor_rollout_ref__model__override_config={"rms_norm_epss": 1e-5}))
    assert msg.startswith(f"{OVERRIDE}.rms_norm_epss is not an attribute of the model's config (Qwen2Config): "
                          "did you mean 'rms_norm_eps'?")
    # verl's usual keys, rope_theta too (transformers 5 keeps it inside rope_parameters)
    validate(grpo(actor_rollout_ref__model__override_config={
        "attention_dropout": 0.0, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))


def test_override_config_cannot_change_the_weights_shapes(run_dir):
    msg = error_of(grpo(actor_rollout_ref__model__override_config={"num_key_value_heads": 4}))
    assert msg.startswith(f"{OVERRIDE}.num_key_value_heads: the checkpoint's weights fix num_key_value_heads "
                          "(it is 2): remove the override")


def test_override_config_values_transformers_refuses(run_dir):
    msg = error_of(grpo(actor_rollout_ref__model__override_config={"rope_scaling": {"rope_type": "linear"}}))
    assert msg.startswith(f"{OVERRIDE}={{'rope_scaling': {{'rope_type': 'linear'}}}} is refused by transformers")
    assert "factor" in msg


def test_overridden_max_position_embeddings_counts_for_the_length_check(run_dir):
    long = dict(data__max_prompt_length=500, data__max_response_length=16)
    assert "= 516 exceeds the model's 512 positions (max_position_embeddings=512)" in error_of(grpo(**long))
    validate(grpo(**long, actor_rollout_ref__model__override_config={"max_position_embeddings": 1024}))
    short = grpo(actor_rollout_ref__model__override_config={"max_position_embeddings": 40})
    assert "data.max_prompt_length + data.max_response_length = 48 exceeds the model's 40 positions " \
           "(max_position_embeddings=40)" in error_of(short)


def test_a_rope_scaling_that_extends_the_model_counts_for_the_length_check(run_dir):
    """vLLM's rule: yarn, linear and dynamic multiply the trained length by their factor; llama3
    and longrope configs already state the extended length in max_position_embeddings."""
    long = dict(data__max_prompt_length=1000, data__max_response_length=24,
                actor_rollout_ref__rollout__max_model_len=2048)
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    validate(grpo(**long, actor_rollout_ref__model__override_config=yarn))
    assert "exceeds the model's 1024 positions (512 positions x rope_scaling factor 2.0 (linear))" in error_of(
        grpo(**long, actor_rollout_ref__model__override_config={"rope_scaling": {"rope_type": "linear",
                                                                                 "factor": 2.0}}))
    llama3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}
    assert "exceeds the model's 512 positions (max_position_embeddings=512)" in error_of(
        grpo(**long, actor_rollout_ref__model__override_config=llama3))


def test_critic_override_config_is_checked_against_its_model(run_dir):
    cfg = grpo(algorithm__adv_estimator="gae", critic__model__override_config={"rope_thetaa": 1.0})
    assert error_of(cfg).startswith("critic.model.override_config.rope_thetaa is not an attribute of the model's "
                                    "config (Qwen2Config): did you mean 'rope_theta'?")
    validate(grpo(critic__model__override_config={"rope_thetaa": 1.0}))  # grpo runs no critic


def test_vllm_hf_overrides_beside_override_config_are_refused(run_dir):
    cfg = grpo(actor_rollout_ref__rollout__engine_kwargs={"vllm": {"hf_overrides": {"rms_norm_eps": 1e-5}}})
    assert f"actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides is set by hybridflow from {OVERRIDE}: " \
           in error_of(cfg)


def test_external_lib_that_cannot_be_imported(run_dir):
    msg = error_of(grpo(actor_rollout_ref__model__external_lib="no_such_module_xyz"))
    assert msg.startswith("actor_rollout_ref.model.external_lib='no_such_module_xyz' cannot be imported "
                          "(ModuleNotFoundError: No module named 'no_such_module_xyz'): install it")
    msg = error_of(grpo(algorithm__adv_estimator="gae", critic__model__external_lib="no_such_module_xyz"))
    assert msg.startswith("critic.model.external_lib='no_such_module_xyz' cannot be imported")
    msg = error_of(grpo(reward_model__enable=True, reward_model__model__path="data/models/tiny-qwen2-sft",
                        reward_model__model__external_lib="no_such_module_xyz"))
    assert msg.startswith("reward_model.model.external_lib='no_such_module_xyz' cannot be imported")


CUSTOM_MODEL_LIB = '''
from transformers import AutoConfig, Qwen2Config


class HFTestTinyConfig(Qwen2Config):
    model_type = "hf_test_tiny"


AutoConfig.register("hf_test_tiny", HFTestTinyConfig, exist_ok=True)
'''


@pytest.fixture
def custom_model_lib(run_dir, monkeypatch):
    """A module that registers a model type with transformers, and a checkpoint of that type."""
    import sys

    (run_dir / "hf_test_model_lib.py").write_text(CUSTOM_MODEL_LIB)
    monkeypatch.syspath_prepend(str(run_dir))
    custom = dict(TINY_MODEL, model_type="hf_test_tiny")
    (run_dir / "data/models/tiny-qwen2-sft/config.json").write_text(json.dumps(custom))
    yield "hf_test_model_lib"
    sys.modules.pop("hf_test_model_lib", None)


def test_external_lib_is_imported_before_the_models_config_is_read(custom_model_lib):
    import sys

    cfg = grpo(actor_rollout_ref__model__external_lib=custom_model_lib,
               actor_rollout_ref__model__override_config={"rms_norm_epss": 1e-5})
    # the override is checked against the class the module registered: it was imported first
    assert "is not an attribute of the model's config (HFTestTinyConfig)" in error_of(cfg)
    assert custom_model_lib in sys.modules
