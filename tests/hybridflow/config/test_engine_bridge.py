"""The config feeds the workers' own dataclasses: names agree and the derived kwargs construct them."""
import pytest

from hybridflow.config import derive, derived, load_config, validate
from recipes.engine_settings import actor_engine_kwargs, critic_engine_kwargs, rollout_engine_kwargs

engine_config = pytest.importorskip("workers.engines.config")
rollout_base = pytest.importorskip("workers.rollout.base")


def test_mirrored_names_match_the_workers():
    assert derived.STRATEGIES == engine_config.STRATEGIES
    # the config adds "auto", which it resolves before any engine sees it
    assert derived.PARAM_DTYPES == ("auto", *engine_config.PARAM_DTYPES)
    assert derived.LR_SCHEDULERS == engine_config.LR_SCHEDULES
    assert derived.ROLLOUT_NAMES == rollout_base.ROLLOUT_NAMES


def test_engine_kwargs_build_valid_engine_configs():
    cfg = load_config({
        "algorithm": {"adv_estimator": "gae"},
        "actor_rollout_ref": {"actor": {
            "strategy": "megatron", "megatron": {"tensor_model_parallel_size": 2},
            "ppo_epochs": 2, "ppo_micro_batch_size_per_gpu": 2, "param_dtype": "bf16",
            "optim": {"lr": 2e-6, "lr_scheduler": "cosine", "lr_warmup_steps_ratio": 0.25,
                      "betas": [0.9, 0.95], "clip_grad": 0.5}},
            "model": {"enable_gradient_checkpointing": True}},
        "critic": {"optim": {"lr": 1e-5, "lr_warmup_steps": 3, "warmup_style": "cosine"},  # verl's name
                   "ppo_micro_batch_size_per_gpu": 2},
        "trainer": {"n_gpus_per_node": 2, "total_epochs": 2, "seed": 7}})
    validate(cfg, check_paths=False)
    d = derive(cfg, dataset_len=16)  # 2 steps/epoch x 2 epochs = 4 steps; 2 minis x 2 epochs each
    actor = engine_config.EngineConfig(**actor_engine_kwargs(cfg, d)).validate()
    assert (actor.strategy, actor.tp, actor.pp, actor.param_dtype) == ("megatron", 2, 1, "bf16")
    assert actor.total_steps == 4 * 4 and actor.warmup_steps == 4  # 25% of 16 optimizer steps
    assert actor.betas == (0.9, 0.95) and actor.grad_clip == 0.5 and actor.lr == 2e-6
    assert actor.micro_batch_size_per_gpu == 2 and actor.gradient_checkpointing and actor.seed == 7
    critic = engine_config.EngineConfig(**critic_engine_kwargs(cfg, d)).validate()
    assert (critic.strategy, critic.tp, critic.lr, critic.warmup_steps) == ("fsdp", 1, 1e-5, 3)
    assert (actor.lr_schedule, critic.lr_schedule) == ("cosine", "cosine")
    cfg.critic.optim.lr_scheduler_type = "constant"  # verl's older warmup_style still wins, as in verl
    validate(cfg, check_paths=False)
    assert engine_config.EngineConfig(**critic_engine_kwargs(cfg, d)).validate().lr_schedule == "cosine"
    cfg.critic.optim.warmup_style = None
    assert engine_config.EngineConfig(**critic_engine_kwargs(cfg, d)).validate().lr_schedule == "constant"


def test_rollout_kwargs_build_the_rollout_config():
    cfg = load_config({"data": {"max_prompt_length": 24, "max_response_length": 12},
                       "actor_rollout_ref": {"rollout": {"n": 4, "temperature": 0.7, "top_k": 5,
                                                         "cpu_live_weights": False, "max_num_batched_tokens": 300,
                                                         "enable_chunked_prefill": False}}})
    r = rollout_base.RolloutConfig(**rollout_engine_kwargs(cfg))
    assert (r.n, r.temperature, r.top_k, r.prompt_length, r.response_length) == (4, 0.7, 5, 24, 12)
    assert (r.max_num_batched_tokens, r.enable_chunked_prefill) == (300, False)
    assert r.cpu_live_weights is False and rollout_base.RolloutConfig().cpu_live_weights is True


def test_weight_sync_bucket_policy_loss_and_lora_reach_the_actor_worker():
    build = pytest.importorskip("recipes.build")
    cfg = load_config({"actor_rollout_ref": {"rollout": {"update_weights_bucket_megabytes": 8},
                                             "actor": {"policy_loss": {"loss_mode": "gspo"}},
                                             "model": {"lora_rank": 8, "target_modules": "q_proj"}},
                       "trainer": {"n_gpus_per_node": 2}})
    settings = build.actor_settings(cfg, derive(cfg, dataset_len=64), ("actor", "rollout"))
    assert settings.reshard_bucket_bytes == 8 << 20
    assert settings.objective.policy_loss == "gspo"
    # LoRA: the actor's adapters; the reference is the base model
    assert (settings.actor.lora_rank, settings.actor.lora_alpha, settings.actor.target_modules) == (8, 16.0, ["q_proj"])
    assert settings.ref.lora_rank == 0 and settings.actor.validate() and settings.ref.validate()
    # the critic's own keys (verl's critic.model.lora_*)
    cfg.critic.model.lora_rank, cfg.critic.model.lora_alpha = 4, 8.0
    critic = critic_engine_kwargs(cfg, derive(cfg, dataset_len=64))
    assert (critic["lora_rank"], critic["lora_alpha"], critic["target_modules"]) == (4, 8.0, ["all-linear"])


def test_forward_only_micro_batch_sizes_reach_each_engine():
    """verl's keys for the forward-only passes: the actor's old log-probs
    (rollout.log_prob_micro_batch_size_per_gpu), the reference's, and the critic's values."""
    build = pytest.importorskip("recipes.build")
    cfg = load_config({"algorithm": {"adv_estimator": "gae"},
                       "actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2},
                                             "rollout": {"log_prob_micro_batch_size_per_gpu": 16},
                                             "ref": {"log_prob_micro_batch_size_per_gpu": 4}},
                       "critic": {"ppo_micro_batch_size_per_gpu": 2, "forward_micro_batch_size_per_gpu": 8},
                       "trainer": {"n_gpus_per_node": 2}})
    d = derive(cfg, dataset_len=64)
    settings = build.actor_settings(cfg, d, ("actor", "rollout", "ref"))
    assert (settings.actor.micro_batch_size_per_gpu, settings.actor.infer_micro) == (2, 16)
    assert settings.ref.infer_micro == 4
    critic = engine_config.EngineConfig(**critic_engine_kwargs(cfg, d))
    assert (critic.micro_batch_size_per_gpu, critic.infer_micro) == (2, 8)
    default = load_config({"algorithm": {"adv_estimator": "gae"}, "critic": {"ppo_micro_batch_size_per_gpu": 2}})
    assert engine_config.EngineConfig(**critic_engine_kwargs(default, derive(default, dataset_len=64))).infer_micro == 2


def test_fsdp_config_reaches_actor_ref_and_critic_engines():
    build = pytest.importorskip("recipes.build")
    cfg = load_config({"algorithm": {"adv_estimator": "gae"},
                       "actor_rollout_ref": {"actor": {"fsdp_config": {"fsdp_size": 1, "forward_prefetch": False}},
                                             "ref": {"fsdp_config": {"fsdp_size": 2}}},
                       "critic": {"model": {"fsdp_config": {"fsdp_size": -1, "forward_prefetch": False}}},
                       "trainer": {"n_gpus_per_node": 2}})
    d = derive(cfg, dataset_len=64)
    settings = build.actor_settings(cfg, d, ("actor", "rollout", "ref"))
    assert (settings.actor.fsdp_size, settings.actor.forward_prefetch) == (1, False)
    assert (settings.ref.fsdp_size, settings.ref.forward_prefetch) == (2, True)
    critic = engine_config.EngineConfig(**critic_engine_kwargs(cfg, d))
    assert (critic.fsdp_size, critic.forward_prefetch) == (-1, False)


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_verl_offload_and_grad_clip_keys_reach_each_engine(strategy):
    """verl's param_offload / optimizer_offload from the strategy's own node (the reference's
    from ref.fsdp_config or ref.megatron), and actor/critic grad_clip over optim.clip_grad."""
    build = pytest.importorskip("recipes.build")
    node = "fsdp_config" if strategy == "fsdp" else "megatron"
    cfg = load_config({"algorithm": {"adv_estimator": "gae"},
                       "actor_rollout_ref": {"actor": {"strategy": strategy, "grad_clip": 0.3,
                                                       node: {"optimizer_offload": True}},
                                             "ref": {node: {"param_offload": True}}},
                       "critic": {"strategy": strategy, "optim": {"clip_grad": 2.0},
                                  **({"model": {"fsdp_config": {"param_offload": True}}} if strategy == "fsdp"
                                     else {"megatron": {"param_offload": True}})},
                       "trainer": {"n_gpus_per_node": 2}})
    d = derive(cfg, dataset_len=64)
    settings = build.actor_settings(cfg, d, ("actor", "rollout", "ref"))
    actor = settings.actor
    assert (actor.param_offload, actor.optimizer_offload, actor.grad_clip) == (False, True, 0.3)
    assert (settings.ref.param_offload, settings.ref.optimizer_offload) == (True, False)
    critic = engine_config.EngineConfig(**critic_engine_kwargs(cfg, d))
    assert (critic.param_offload, critic.optimizer_offload, critic.grad_clip) == (True, False, 2.0)


@pytest.mark.parametrize("param_dtype,rollout_dtype,expected", [
    ("fp32", "auto", "float32"), ("bf16", "auto", "bfloat16"), ("fp32", "bfloat16", "bfloat16")])
def test_rollout_dtype_auto_follows_the_actor_compute_dtype(param_dtype, rollout_dtype, expected):
    """Not the checkpoint's dtype: a bf16-saved model trained in fp32 must also generate in fp32."""
    cfg = load_config({"actor_rollout_ref": {"actor": {"param_dtype": param_dtype},
                                             "rollout": {"dtype": rollout_dtype}}})
    assert rollout_base.RolloutConfig(**rollout_engine_kwargs(cfg)).dtype == expected


@pytest.mark.parametrize("critic_model,critic_override,critic_lib", [
    ({}, {"rms_norm_eps": 0.3}, "actor_lib"),  # the critic starts from the actor's model: the actor's keys
    ({"override_config": {"attention_dropout": 0.1}, "external_lib": "critic_lib"}, {"attention_dropout": 0.1},
     "critic_lib"),
    # another checkpoint: none of the actor's overrides, but its external_lib (as in verl: usually
    # the same architecture)
    ({"path": "/other/model"}, {}, "actor_lib"),
])
def test_override_config_and_external_lib_reach_every_model(critic_model, critic_override, critic_lib):
    build = pytest.importorskip("recipes.build")
    cfg = load_config({"algorithm": {"adv_estimator": "gae"},
                       "actor_rollout_ref": {"model": {"override_config": {"rms_norm_eps": 0.3},
                                                       "external_lib": "actor_lib"}},
                       "critic": {"model": critic_model}, "trainer": {"n_gpus_per_node": 2}})
    d = derive(cfg, dataset_len=64)
    settings = build.actor_settings(cfg, d, ("actor", "rollout", "ref"))
    assert settings.actor.override_config == settings.ref.override_config == {"rms_norm_eps": 0.3}
    assert settings.rollout.hf_overrides == {"rms_norm_eps": 0.3} and settings.external_lib == "actor_lib"
    critic = build.role_specs(cfg, d)[1]["critic"].args[0]
    assert (critic.engine.override_config, critic.external_lib) == (critic_override, critic_lib)


@pytest.mark.parametrize("fused", [False, True])
def test_the_fused_update_reverses_the_critics_pipeline_only(fused):
    """stage_fusion.fuse_actor_critic_update builds the critic's engine with its stages reversed
    (workers/engines/megatron_fused.py); the actor's keeps the plain layout the resharding reads."""
    megatron = {"strategy": "megatron", "megatron": {"pipeline_model_parallel_size": 2}}
    cfg = load_config({"algorithm": {"adv_estimator": "gae"}, "actor_rollout_ref": {"actor": megatron},
                       "critic": megatron, "stage_fusion": {"fuse_actor_critic_update": fused},
                       "trainer": {"n_gpus_per_node": 2}})
    validate(cfg, check_paths=False)
    d = derive(cfg, dataset_len=16)
    critic = engine_config.EngineConfig(**critic_engine_kwargs(cfg, d)).validate()
    actor = engine_config.EngineConfig(**actor_engine_kwargs(cfg, d)).validate()
    assert (critic.pp, critic.reverse_pipeline, actor.reverse_pipeline) == (2, fused, False)
