"""Every ``auto`` is resolved once, when the config is loaded: what derive and the engines' settings
read afterwards is concrete, and asking again changes nothing and asks the machine nothing."""
import copy

import pytest

from hybridflow import device
from hybridflow.config import derive, load_config
from hybridflow.config.resolve import resolve
from recipes.engine_settings import (
    actor_engine_kwargs, critic_engine_kwargs, ref_engine_kwargs, rollout_engine_kwargs,
)

# PPO with a critic, GRPO with a KL loss (a reference), Megatron, LoRA
RUNS = [{"algorithm": {"adv_estimator": "gae"}},
        {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"use_kl_loss": True}}},
        {"algorithm": {"adv_estimator": "gae"}, "actor_rollout_ref": {"actor": {"strategy": "megatron"}},
         "critic": {"strategy": "megatron"}},
        {"actor_rollout_ref": {"model": {"lora_rank": 8}, "actor": {"use_kl_loss": True}}}]


def engine_settings(cfg) -> dict:
    d = derive(cfg, dataset_len=64)
    return {"actor": actor_engine_kwargs(cfg, d), "ref": ref_engine_kwargs(cfg, d),
            "rollout": rollout_engine_kwargs(cfg), **({"critic": critic_engine_kwargs(cfg, d)} if d.use_critic else {})}


@pytest.mark.parametrize("run", RUNS)
def test_no_engine_setting_says_auto_after_loading(run, monkeypatch):
    cfg = load_config({**run, "trainer": {"n_gpus_per_node": 2}})

    def ask_again(*_):
        raise AssertionError("param_dtype=auto resolved after load_config")

    monkeypatch.setattr(device, "auto_param_dtype", ask_again)
    settings = engine_settings(cfg)
    said_auto = [(role, k) for role, kwargs in settings.items() for k, v in kwargs.items()
                 if v == "auto" and k != "load_format"]  # load_format=auto is vLLM's own (read the checkpoint)
    assert not said_auto
    before = copy.deepcopy(cfg)
    assert resolve(cfg) == before  # a resolved config has nothing left to resolve


def test_rollout_dtype_is_resolved_with_the_actor_param_dtype(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_AUTO_DTYPE", "bf16")
    cfg = load_config({})
    assert (cfg.actor_rollout_ref.actor.param_dtype, cfg.actor_rollout_ref.rollout.dtype) == ("bf16", "bfloat16")
    # an unknown param_dtype leaves rollout.dtype for validate, which names the param_dtype
    bad = load_config({"actor_rollout_ref": {"actor": {"param_dtype": "fp16"}}})
    assert bad.actor_rollout_ref.rollout.dtype == "auto"


@pytest.mark.parametrize("actor, algorithm, expected", [
    ({}, {}, "skip"),  # the default: one mini-batch of the whole batch, one epoch
    ({"ppo_epochs": 2}, {}, "always"),
    ({"ppo_mini_batch_size": 2}, {}, "always"),
    ({}, {"use_kl_in_reward": True}, "always"),
    ({"recompute_old_log_prob": "always"}, {}, "always"),
])
def test_recompute_old_log_prob_auto_is_decided_at_load(actor, algorithm, expected):
    cfg = load_config({"data": {"train_batch_size": 4}, "algorithm": algorithm,
                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, **actor}}})
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == expected


def test_skipping_the_old_log_prob_forward_off_policy_is_refused():
    from hybridflow.config import ConfigError, validate

    cfg = load_config({"data": {"train_batch_size": 4}, "trainer": {"n_gpus_per_node": 2},
                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_epochs": 2,
                                                       "recompute_old_log_prob": "skip"}}})
    with pytest.raises(ConfigError, match=r"recompute_old_log_prob=skip needs a strictly on-policy update"):
        validate(cfg, check_paths=False)


def test_group_by_length_reaches_each_engine_from_its_model_section():
    cfg = load_config({"algorithm": {"adv_estimator": "gae"}, "trainer": {"n_gpus_per_node": 2},
                       "actor_rollout_ref": {"model": {"group_by_length": False}, "actor": {"use_kl_loss": True}}})
    settings = engine_settings(cfg)
    assert not settings["actor"]["group_by_length"] and not settings["ref"]["group_by_length"]
    assert settings["critic"]["group_by_length"]  # the critic's own key, on by default
    cfg.critic.model.group_by_length = False
    assert not engine_settings(cfg)["critic"]["group_by_length"]
