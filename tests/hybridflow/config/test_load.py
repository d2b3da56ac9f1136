"""Hydra YAML -> typed dataclasses: every recipe composes, unknown keys and wrong types are named."""
import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from hybridflow.config import ConfigError, RootConfig, derive, dotted_keys, load_config, validate
from hybridflow.config.resolve import say_once
from hybridflow.config.sft import SFTConfig, load_sft_config, validate_sft
from recipes.cli import cli_info, compose_config, split_cli_args
from recipes.engine_settings import rollout_engine_kwargs as derive_rollout_kwargs

RL_RECIPES = ["ppo", "grpo", "remax", "dapo", "gspo"]


def test_base_yaml_is_exactly_the_dataclass_defaults():
    # the `base` Hydra composes (registered from the dataclasses by recipes/cli.py) lists every key
    # with its default: --cfg job and overrides see exactly the tree load_config builds
    assert load_config(compose_config("base")) == load_config({})
    yaml_keys = set()

    def walk(node, prefix):
        for k, v in node.items():
            yaml_keys.add(prefix + k)
            if isinstance(v, dict) and k not in ("reward_kwargs", "apply_chat_template_kwargs", "vllm"):
                walk(v, prefix + k + ".")

    walk(OmegaConf.to_container(compose_config("base")), "")
    assert yaml_keys == set(dotted_keys(RootConfig))


def test_sft_yaml_is_exactly_the_dataclass_defaults():
    assert load_sft_config(compose_config("sft", schema=SFTConfig)) == load_sft_config({})


@pytest.mark.parametrize("name,estimator,critic,reference", [
    ("ppo", "gae", True, False), ("grpo", "grpo", False, True), ("remax", "remax", False, True),
    ("dapo", "grpo", False, False), ("gspo", "grpo", False, False)])
def test_recipes_compose_and_validate(name, estimator, critic, reference):
    cfg = load_config(compose_config(name, ["trainer.total_training_steps=3"]))
    assert cfg.algorithm.adv_estimator == estimator
    assert cfg.trainer.total_training_steps == 3
    assert cfg.trainer.experiment_name == name
    validate(cfg, check_paths=False)
    d = derive(cfg)
    assert (d.use_critic, d.use_reference) == (critic, reference)


def test_the_default_recipe_trains_a_critic_only_for_an_estimator_that_needs_one():
    # verl's main_ppo with algorithm.adv_estimator=grpo and no --config-name has no critic
    assert derive(load_config(compose_config("ppo"))).use_critic
    assert not derive(load_config(compose_config("ppo", ["algorithm.adv_estimator=grpo"]))).use_critic


def test_grpo_recipe_has_groups_and_low_var_kl_loss():
    cfg = load_config(compose_config("grpo"))
    arr = cfg.actor_rollout_ref
    assert arr.rollout.n >= 4 and arr.actor.use_kl_loss and arr.actor.kl_loss_type == "low_var_kl"
    assert cfg.critic.enable is False


def test_overrides_are_typed_and_interpolations_resolved():
    cfg = load_config(compose_config("grpo", [
        "actor_rollout_ref.actor.optim.lr=3e-6", "trainer.experiment_name=123",
        "trainer.logger=[console,tensorboard]", "data.train_files=a.parquet",
        "critic.enable=null"]), base_dir="/runs")
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.experiment_name == "123"  # Hydra parsed it as an int; names are strings
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.data.train_files == ["/runs/a.parquet"]  # a single value becomes a list
    assert cfg.trainer.default_local_dir == "/runs/checkpoints/hybridflow/123"
    assert cfg.critic.enable is None


@pytest.mark.parametrize("machine", ["fp32", "bf16"])
def test_param_dtype_auto_is_resolved_before_anything_reads_it(monkeypatch, capsys, machine):
    # HYBRIDFLOW_AUTO_DTYPE stands in for the machine's answer (device.auto_param_dtype's own tests
    # cover the measuring); explicit values are kept, an unknown one is left for validate to name
    monkeypatch.setenv("HYBRIDFLOW_AUTO_DTYPE", machine)
    say_once.cache_clear()  # the line is said once per process
    cfg = load_config(compose_config("ppo", ["critic.param_dtype=fp32"]))
    assert (cfg.actor_rollout_ref.actor.param_dtype, cfg.critic.param_dtype) == (machine, "fp32")
    rollout = derive_rollout_kwargs(cfg)
    assert rollout["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[machine]  # vLLM follows the actor
    assert load_sft_config({}).model.param_dtype == machine
    assert load_config(compose_config("grpo")).critic.param_dtype == "auto"  # no critic: left alone
    assert f"param_dtype=auto -> {machine}" in capsys.readouterr().err
    bad = load_config(compose_config("ppo", ["actor_rollout_ref.actor.param_dtype=fp16"]))
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.param_dtype='fp16'"):
        validate(bad, check_paths=False)


def test_a_hand_built_config_left_at_auto_reaches_the_engines_resolved(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_AUTO_DTYPE", "bf16")
    from recipes.engine_settings import actor_engine_kwargs

    cfg = RootConfig()  # the programmatic API need not go through load_config
    assert cfg.actor_rollout_ref.actor.param_dtype == "auto"
    assert actor_engine_kwargs(cfg, derive(cfg))["param_dtype"] == "bf16"


def test_default_paths_are_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config({"trainer": {"resume_mode": "~/ckpt/global_step_2"}})
    assert cfg.actor_rollout_ref.model.path == str(tmp_path / "data/models/tiny-qwen2-sft")
    assert cfg.data.val_files == [str(tmp_path / "data/arithmetic/val.parquet")]
    assert cfg.trainer.resume_mode == os.path.expanduser("~/ckpt/global_step_2")
    assert load_config({}).trainer.resume_mode == "auto"
    # verl's form: resume_mode=resume_path with resume_from_path
    verl = load_config({"trainer": {"resume_mode": "resume_path", "resume_from_path": "ckpt/global_step_4"}})
    assert verl.trainer.resume_mode == str(tmp_path / "ckpt/global_step_4")
    with pytest.raises(ConfigError, match="resume_mode=resume_path needs trainer.resume_from_path"):
        load_config({"trainer": {"resume_mode": "resume_path"}})


def test_unknown_override_without_plus_names_key_and_suggestion():
    with pytest.raises(ConfigError) as err:
        compose_config("grpo", ["actor_rollout_ref.actor.ppo_mini_batchsize=4"])
    assert str(err.value) == ("unknown config key 'actor_rollout_ref.actor.ppo_mini_batchsize' "
                              "(did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?)")


def test_unknown_key_added_with_plus_or_in_yaml_is_rejected_by_load_config():
    with pytest.raises(ConfigError) as err:
        load_config(compose_config("ppo", ["+actor_rollout_ref.actor.ppo_mini_batchsize=4"]))
    assert "'actor_rollout_ref.actor.ppo_mini_batchsize'" in str(err.value)
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in str(err.value)


def test_key_in_the_wrong_section_suggests_where_it_lives():
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.rollout_n'.*"
                                          r"did you mean 'actor_rollout_ref.rollout.n'"):
        load_config({"actor_rollout_ref": {"actor": {"rollout_n": 4}}})


@pytest.mark.parametrize("key", ["data.tokenizer", "actor_rollout_ref.actor.data_loader_seed"])
def test_no_suggestion_from_a_shared_section_alone(key):
    """'data.tokenizer' is nothing like 'data.seed': the shared 'data.' made them look close."""
    with pytest.raises(ConfigError) as err:
        compose_config("grpo", [f"{key}=1"])
    assert str(err.value) == f"unknown config key '{key}'"


def test_every_problem_is_reported_on_one_line():
    with pytest.raises(ConfigError) as err:
        load_config({"data": {"train_batch_size": "8", "max_prompt_length": 1.5, "shuffle": 1},
                     "trainer": {"lgger": ["console"], "total_epochs": True}})
    msg = str(err.value)
    assert "\n" not in msg
    assert "'data.train_batch_size' must be an integer, got str '8' (remove the quotes)" in msg
    assert "'data.max_prompt_length' must be an integer, got float 1.5" in msg
    assert "'data.shuffle' must be a boolean" in msg
    assert "unknown config key 'trainer.lgger' (did you mean 'trainer.logger'?)" in msg
    assert "'trainer.total_epochs' must be an integer, got bool True" in msg


def test_wrong_type_from_the_command_line():
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.rollout.n' must be an integer, got str 'four'"):
        load_config(compose_config("grpo", ["actor_rollout_ref.rollout.n=four"]))


def test_scalar_where_a_section_belongs():
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.optim' must be a section"):
        load_config({"actor_rollout_ref": {"actor": {"optim": 1e-6}}})


def test_list_elements_are_typed():
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.optim.betas\[1\]' must be a number"):
        load_config({"actor_rollout_ref": {"actor": {"optim": {"betas": [0.9, "x"]}}}})


def test_null_list_means_none_and_validation_says_what_that_needs():
    cfg = load_config(compose_config("grpo", ["data.val_files=null"]))
    assert cfg.data.val_files == []
    with pytest.raises(ConfigError, match=r"data.val_files is empty but validation is on: .*trainer.test_freq=-1"):
        validate(cfg)  # (the default model and data paths may be missing too: other errors on the line)
    cfg = load_config(compose_config("grpo", ["data.val_files=null", "trainer.test_freq=-1",
                                              "trainer.val_before_train=false"]))
    try:
        validate(cfg)
    except ConfigError as err:
        assert "val_files" not in str(err)


def test_unresolvable_interpolation_names_the_key():
    with pytest.raises(ConfigError, match="trainer.experiment_name"):
        load_config(OmegaConf.create({"trainer": {"experiment_name": "${nope.missing}"}}))


def test_split_cli_args():
    assert split_cli_args(["--config-name", "grpo", "a=1"], "ppo") == ("grpo", ["a=1"])
    assert split_cli_args(["-cn", "remax"], "ppo") == ("remax", [])
    assert split_cli_args(["--config-name=grpo", "+b=2"], "ppo") == ("grpo", ["+b=2"])
    assert split_cli_args(["x=1"], "ppo") == ("ppo", ["x=1"])


def test_an_unknown_config_name_lists_the_recipes_and_maps_verls_names():
    with pytest.raises(ConfigError, match=r"--config-name ppo_trainer: no such config .*: use one of "
                                          r"base, dapo, grpo, grpo_async, grpo_tools, gspo, ppo, remax, sft \(verl's ppo_trainer is 'ppo' here\)"):
        compose_config("ppo_trainer")
    assert compose_config("grpo.yaml").algorithm.adv_estimator == "grpo"


def test_sft_recipe_loads_and_rejects_unknown_keys():
    cfg = load_sft_config(compose_config("sft", ["optim.lr=3e-4", "trainer.total_epochs=1"],
                                         schema=SFTConfig))
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.trainer.total_epochs == 1
    validate_sft(cfg, check_paths=False)
    with pytest.raises(ConfigError, match=r"unknown config key 'data.response_keys' \(did you mean 'data.response_key'\?\)"):
        compose_config("sft", ["data.response_keys=answer"], schema=SFTConfig)
    lora = load_sft_config(compose_config("sft", ["model.lora_rank=8", "model.strategy=megatron"], schema=SFTConfig))
    with pytest.raises(ConfigError, match=r"model.lora_rank=8: LoRA adapters are implemented for model.strategy=fsdp"):
        validate_sft(lora, check_paths=False)


def test_sft_takes_verls_name_for_the_model():
    cfg = load_sft_config(compose_config("sft", ["model.partial_pretrain=/models/qwen"], schema=SFTConfig))
    assert cfg.model.path == "/models/qwen"


def test_sft_takes_verls_fsdp_sft_trainer_keys(tmp_path):
    """Keys of verl's fsdp_sft_trainer.yaml that have a meaning here, under verl's names."""
    cfg = load_sft_config(compose_config("sft", [
        "optim.warmup_steps_ratio=0.1", "data.micro_batch_size=8", "trainer.n_gpus_per_node=2",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/run",
        f"trainer.default_local_dir={tmp_path}/out"], schema=SFTConfig))
    assert cfg.optim.lr_warmup_steps_ratio == 0.1
    assert cfg.trainer.resume_mode == f"{tmp_path}/run"
    # the final model goes beside the run's checkpoints, not over the demo's model
    assert cfg.trainer.hf_output_dir == f"{tmp_path}/out/hf"
    validate_sft(cfg, check_paths=False)
    assert (cfg.data.micro_batch_size_per_gpu, cfg.data.micro_batch_size) == (4, None)  # 8 over 2 workers
    odd = load_sft_config(compose_config("sft", ["data.micro_batch_size=3", "trainer.n_gpus_per_node=2"],
                                         schema=SFTConfig))
    with pytest.raises(ConfigError, match=r"data.micro_batch_size=3 \(verl's deprecated size over all 2"):
        validate_sft(odd, check_paths=False)


def test_sft_missing_model_is_one_line_with_the_hub_hint(tmp_path, monkeypatch):
    """The SFT path check named a helper it imported only further down (UnboundLocalError)."""
    monkeypatch.chdir(tmp_path)
    cfg = load_sft_config(compose_config("sft", ["model.path=Qwen/Qwen2.5-0.5B-Instruct",
                                                 f"trainer.default_local_dir={tmp_path}/out"], schema=SFTConfig))
    with pytest.raises(ConfigError, match=r"model.path: .*Qwen/Qwen2.5-0.5B-Instruct is not an HF checkpoint "
                                          r"directory .*download it first \(`hf download Qwen/Qwen2.5-0.5B-Instruct"):
        validate_sft(cfg)


def test_sft_runs_a_verl_sft_scripts_keys():
    cfg = load_sft_config(compose_config("sft", [
        "use_remove_padding=true", "ulysses_sequence_parallel_size=1", "data.prompt_key=extra_info",
        "data.prompt_dict_keys=[question]", "+data.response_dict_keys=[answer]", "model.trust_remote_code=false",
        "trainer.default_hdfs_dir=null"], schema=SFTConfig))
    assert cfg.data.prompt_dict_keys == ["question"] and cfg.data.response_dict_keys == ["answer"]
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=2: Ulysses sequence parallelism is not"):
        load_sft_config(compose_config("sft", ["ulysses_sequence_parallel_size=2"], schema=SFTConfig))


def test_fsdp2_is_verls_name_for_the_fsdp_engine():
    cfg = load_config(compose_config("ppo", ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
                                             "actor_rollout_ref.ref.strategy=fsdp2"]))
    assert (cfg.actor_rollout_ref.actor.strategy, cfg.critic.strategy, cfg.actor_rollout_ref.ref.strategy) == \
        ("fsdp", "fsdp", "fsdp")
    sft = load_sft_config(compose_config("sft", ["model.strategy=fsdp2"], schema=SFTConfig))
    assert sft.model.strategy == "fsdp"


def test_sft_batch_must_tile_micro_batches_over_workers():
    cfg = load_sft_config({"data": {"train_batch_size": 12, "micro_batch_size_per_gpu": 4},
                           "trainer": {"n_gpus_per_node": 2}})
    with pytest.raises(ConfigError, match=r"data.train_batch_size=12 must be a multiple of "
                                          r"data.micro_batch_size_per_gpu=4 x 2"):
        validate_sft(cfg, check_paths=False)


def test_sft_fsdp_size_must_divide_the_workers():
    cfg = load_sft_config({"model": {"fsdp_config": {"fsdp_size": 3}}, "data": {"train_batch_size": 16},
                           "trainer": {"n_gpus_per_node": 2}})
    with pytest.raises(ConfigError, match=r"model.fsdp_config.fsdp_size=3 must be -1 .* use one of \[-1, 1, 2\]"):
        validate_sft(cfg, check_paths=False)
    cfg.model.fsdp_config.fsdp_size = 1
    validate_sft(cfg, check_paths=False)


def test_ray_address_env_joins_an_existing_cluster(monkeypatch):
    from recipes.main_ppo import ray_address_from_env

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address_from_env(load_sft_config({})).ray_init.address == "10.0.0.1:6379"
    explicit = load_config({"ray_init": {"address": "auto"}})
    assert ray_address_from_env(explicit).ray_init.address == "auto"  # the config wins


def test_ray_kwargs_ray_init_is_verls_newer_ray_init():
    cfg = load_config(compose_config("grpo", ["ray_kwargs.ray_init.num_cpus=3"]))
    assert cfg.ray_init.num_cpus == 3
    assert load_config(compose_config("grpo", ["ray_init.num_cpus=3", "ray_kwargs.ray_init.num_cpus=3"])) == cfg
    with pytest.raises(ConfigError, match=r"^ray_kwargs.ray_init.num_cpus=4 and ray_init.num_cpus=3 set the same"):
        load_config(compose_config("grpo", ["ray_init.num_cpus=3", "ray_kwargs.ray_init.num_cpus=4"]))


def test_config_round_trips_through_asdict():
    # The trainer logs dataclasses.asdict(cfg); loading that back must give the same config.
    cfg = load_config(compose_config("ppo"))
    assert load_config(dataclasses.asdict(cfg)) == cfg


def test_help_and_cfg_job_print_instead_of_running():
    """``--help`` names the configs; Hydra's ``--cfg job`` prints the composed config with the
    overrides applied, as YAML that loads back to the same run config; anything else runs."""
    assert cli_info(["--config-name", "grpo", "data.seed=1"], "ppo", "usage") is None
    help_text = cli_info(["-h"], "ppo", "usage: main_ppo")
    assert help_text.startswith("usage: main_ppo") and "grpo, grpo_async, grpo_tools, gspo, ppo, remax" in help_text
    printed = cli_info(["--config-name", "grpo", "--cfg", "job", "actor_rollout_ref.rollout.n=8"], "ppo", "")
    loaded = load_config(OmegaConf.create(printed))
    assert loaded == load_config(compose_config("grpo", ["actor_rollout_ref.rollout.n=8"]))
    assert loaded.actor_rollout_ref.rollout.n == 8
    sft = cli_info(["--cfg", "job", "model.path=my/model"], "sft", "", schema=SFTConfig)
    assert load_sft_config(OmegaConf.create(sft)).model.path.endswith("my/model")
    with pytest.raises(ConfigError, match="--cfg takes 'job'"):
        cli_info(["--cfg", "hydra"], "ppo", "")
    with pytest.raises(ConfigError, match="did you mean 'model.path'"):
        cli_info(["--cfg", "job", "model.pth=x"], "sft", "", schema=SFTConfig)
    with pytest.raises(ConfigError, match="unknown config key 'trainer.new_key'"):  # Hydra adds it; the run would not
        cli_info(["--cfg", "job", "+trainer.new_key=1"], "ppo", "")
