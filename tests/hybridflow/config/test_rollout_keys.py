"""verl's rollout keys (do_sample, ignore_eos, max_model_len, enable_prefix_caching,
disable_log_stats, load_format, engine_kwargs.vllm): each config error is one line naming the
key and the fix, and each value reaches the engine's RolloutConfig. No Ray, no vLLM engine."""
import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.rules import ROLLOUT_LOAD_FORMATS, VLLM_KWARGS_FIXED, VLLM_KWARGS_FROM_KEYS
from recipes.cli import compose_config
from recipes.engine_settings import rollout_engine_kwargs
from workers.rollout.base import RolloutConfig

R = "actor_rollout_ref.rollout"


def config(**rollout):
    """Prompt 32 + response 16 tokens, with rollout keys set."""
    return load_config({"data": {"max_prompt_length": 32, "max_response_length": 16},
                        "actor_rollout_ref": {"rollout": rollout}})


def errors_of(**rollout) -> str:
    with pytest.raises(ConfigError) as e:
        validate(config(**rollout), check_paths=False)
    message = str(e.value)
    assert "\n" not in message
    return message


def engine_config(**rollout) -> RolloutConfig:
    cfg = config(**rollout)
    validate(cfg, check_paths=False)
    return RolloutConfig(**rollout_engine_kwargs(cfg))


def test_defaults_keep_todays_engine_settings():
    r = engine_config()
    assert (r.do_sample, r.ignore_eos, r.max_model_len, r.load_format, r.vllm_engine_kwargs) == (
        True, False, None, "auto", {})
    assert (r.enable_prefix_caching, r.disable_log_stats) == (True, True)  # vLLM's own CPU defaults
    assert r.context_length == 32 + 16  # max_model_len null: prompt + response, as before


def test_greedy_training_rollouts_need_one_sample_per_prompt():
    message = errors_of(do_sample=False, n=4)
    assert f"{R}.n=4 with {R}.do_sample=false repeats one greedy response" in message
    assert f"set {R}.n=1 or {R}.do_sample=true" in message
    r = engine_config(do_sample=False, n=1)
    assert r.do_sample is False


def test_ignore_eos_reaches_the_engine_config_for_both_backends():
    assert engine_config(ignore_eos=True).ignore_eos is True
    assert engine_config(ignore_eos=True, name="hf").ignore_eos is True  # the HF rollout honours it too


def test_max_model_len_must_hold_prompt_and_response():
    message = errors_of(max_model_len=47)
    assert f"{R}.max_model_len=47 cannot hold data.max_prompt_length + data.max_response_length = 48" \
           in message and "raise it to >= 48 or set it to null" in message
    r = engine_config(max_model_len=64)
    assert (r.max_model_len, r.context_length) == (64, 64)


def test_scheduler_rule_checks_the_engines_context_length():
    """Without chunked prefill one engine step must hold a whole max_model_len sequence (vLLM's rule)."""
    message = errors_of(max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert "max_num_batched_tokens=256 with enable_chunked_prefill=false cannot hold" in message
    assert "= 512 tokens" in message
    validate(config(enable_chunked_prefill=False, max_num_batched_tokens=256), check_paths=False)  # 48 fits


def test_vllm_switches_reach_the_engine_config():
    r = engine_config(enable_prefix_caching=False, disable_log_stats=False)
    assert (r.enable_prefix_caching, r.disable_log_stats) == (False, False)


@pytest.mark.parametrize("verl,vllm", [("auto", "auto"), ("dummy", "dummy"), ("dummy_dtensor", "dummy"),
                                       ("dummy_hf", "dummy"), ("dummy_megatron", "dummy"),
                                       ("safetensors", "safetensors"), ("hf", "hf")])
def test_load_format_maps_verls_dummy_family_to_vllms_dummy(verl, vllm):
    assert engine_config(load_format=verl).load_format == vllm


def test_unknown_load_format_lists_the_allowed_ones():
    message = errors_of(load_format="dtensor")
    assert f"{R}.load_format='dtensor' is unknown: use one of {', '.join(ROLLOUT_LOAD_FORMATS)}" in message


def test_engine_kwargs_pass_through_to_the_engine_config():
    r = engine_config(engine_kwargs={"vllm": {"max_logprobs": 5, "block_size": 32}})
    assert r.vllm_engine_kwargs == {"max_logprobs": 5, "block_size": 32}


@pytest.mark.parametrize("name,instead", [("seed", "trainer.seed"), ("model", "actor_rollout_ref.model.path"),
                                          ("dtype", f"{R}.dtype"),
                                          ("tensor_parallel_size", f"{R}.tensor_model_parallel_size"),
                                          ("max_model_len", f"{R}.max_model_len")])
def test_engine_kwargs_cannot_override_what_hybridflow_sets(name, instead):
    message = errors_of(engine_kwargs={"vllm": {name: 1}})
    assert f"{R}.engine_kwargs.vllm.{name} is set by hybridflow from {instead}: remove it here" in message


@pytest.mark.parametrize("name", sorted(VLLM_KWARGS_FIXED))
def test_engine_kwargs_cannot_change_what_the_rollout_relies_on(name):
    message = errors_of(engine_kwargs={"vllm": {name: "x"}})
    assert f"{R}.engine_kwargs.vllm.{name} is fixed by hybridflow (" in message and "remove it" in message


def test_reserved_vllm_arguments_are_disjoint():
    assert not set(VLLM_KWARGS_FROM_KEYS) & set(VLLM_KWARGS_FIXED)


def test_engine_kwargs_vllm_with_the_hf_rollout_is_an_error():
    message = errors_of(name="hf", engine_kwargs={"vllm": {"max_logprobs": 5}})
    assert f"{R}.engine_kwargs.vllm={{'max_logprobs': 5}} is passed to vLLM, but {R}.name=hf" in message
    assert f"set {R}.name=vllm" in message


@pytest.mark.parametrize("override", ["actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
                                      "custom_reward_function.reward_kwargs.scale=2"])
def test_a_new_key_in_a_free_form_mapping_says_to_add_it_with_plus(override):
    with pytest.raises(ConfigError) as e:
        compose_config("ppo", [override])
    key = override.split("=")[0]
    assert f"config key '{key}' is new" in str(e.value)
    assert f"add a key to it with Hydra's '+' prefix: +{override}" in str(e.value)
    assert "did you mean" not in str(e.value)


def test_a_plus_override_adds_the_key_and_a_typo_elsewhere_is_still_named():
    cfg = load_config(compose_config("ppo", [f"+{R}.engine_kwargs.vllm.max_logprobs=4"]))
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {"max_logprobs": 4}
    with pytest.raises(ConfigError) as e:  # the '+' override is fine: only the typo is reported
        compose_config("ppo", [f"+{R}.engine_kwargs.vllm.max_logprobs=4", f"{R}.temprature=0.5"])
    assert str(e.value) == f"unknown config key '{R}.temprature' (did you mean '{R}.temperature'?)"
