"""Each validation rule fires with a message naming its key; a valid tiny config passes."""
import json
import logging

import pytest

from hybridflow.config import derive, validate
from hybridflow.device import device_count
from tests.hybridflow.config.validate_helpers import TINY_MODEL, error_of, grpo, run_dir  # noqa: F401  (a fixture)


def test_valid_tiny_config_passes_and_derives_sizes(run_dir):
    cfg = grpo()
    validate(cfg, available_slots=2)  # reads the model's config.json from model.path
    d = derive(cfg, dataset_len=100)
    assert (d.actor_world, d.actor_dp, d.rollout_dp, d.total_workers) == (2, 2, 2, 2)
    assert d.sequences_per_step == 32
    assert d.actor_mini_batches_per_epoch == 2  # 8 prompts / 4 per mini-batch
    assert d.actor_micro_batches_per_mini == 1  # 4*4 seqs / 2 ranks = 8 per rank = 1 micro of 8
    assert (d.steps_per_epoch, d.total_training_steps) == (12, 12)  # last partial batch dropped


@pytest.mark.parametrize("overrides,needle", [
    # batch sizes (verl: mini counts prompts, x n sequences, over dp ranks, into micro-batches)
    (dict(actor_rollout_ref__actor__ppo_mini_batch_size=3),
     "data.train_batch_size=8 must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=3"),
    (dict(actor_rollout_ref__rollout__n=3, actor_rollout_ref__actor__ppo_mini_batch_size=1,
          trainer__n_gpus_per_node=2),
     "actor_rollout_ref.actor.ppo_mini_batch_size=1 x actor_rollout_ref.rollout.n=3 = 3 sequences"),
    (dict(actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=3),
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3 must divide the 8 sequences"),
    # parallel sizes vs world
    (dict(actor_rollout_ref__actor__strategy="megatron",
          actor_rollout_ref__actor__megatron__tensor_model_parallel_size=4),
     "actor_rollout_ref.actor.megatron (tensor x pipeline parallel): 2 workers cannot be split into tp*pp=4"),
    (dict(actor_rollout_ref__rollout__tensor_model_parallel_size=4),
     "actor_rollout_ref.rollout.tensor_model_parallel_size: 2 workers cannot be split into tp=4"),
    (dict(trainer__n_gpus_per_node=4, actor_rollout_ref__actor__strategy="megatron",
          actor_rollout_ref__actor__megatron__pipeline_model_parallel_size=2,
          actor_rollout_ref__rollout__tensor_model_parallel_size=2),
     "actor_rollout_ref.rollout.tensor_model_parallel_size=2 must divide actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"),
    (dict(algorithm__adv_estimator="gae", actor_rollout_ref__actor__strategy="megatron",
          actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2, critic__strategy="megatron",
          critic__megatron__pipeline_model_parallel_size=2),
     "critic.megatron (tp=1, pp=2) differs from actor_rollout_ref.actor.megatron (tp=2, pp=1), but "
     "trainer.placement=colocate runs both in one process"),
    (dict(actor_rollout_ref__actor__megatron__tensor_model_parallel_size=2),
     "actor_rollout_ref.actor.megatron.* sizes only apply to actor_rollout_ref.actor.strategy=megatron"),
    (dict(actor_rollout_ref__rollout__name="hf", actor_rollout_ref__rollout__tensor_model_parallel_size=2),
     "actor_rollout_ref.rollout.name=hf runs one full model per worker"),
    (dict(actor_rollout_ref__rollout__name="hf", actor_rollout_ref__actor__strategy="megatron"),
     "actor_rollout_ref.rollout.name=hf generates with the actor's own HF module, which "
     "actor_rollout_ref.actor.strategy=megatron does not have"),
    (dict(actor_rollout_ref__actor__fsdp_config__fsdp_size=3),
     "actor_rollout_ref.actor.fsdp_config.fsdp_size=3 must be -1 (shard over all 2 workers), 1 (replicate) "
     "or a divisor of 2"),
    (dict(actor_rollout_ref__ref__fsdp_config__fsdp_size=0), "actor_rollout_ref.ref.fsdp_config.fsdp_size=0 must be"),
    (dict(actor_rollout_ref__actor__fsdp_config__fsdp_size=1, actor_rollout_ref__actor__fsdp_config__param_offload=True),
     "actor_rollout_ref.actor.fsdp_config.param_offload=true needs sharded parameters, but fsdp_size=1 makes each "
     "of the 2 workers hold the whole model (DDP): set actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"),
    (dict(critic__strategy="megatron", critic__model__fsdp_config__fsdp_size=2),
     "critic.model.fsdp_config.fsdp_size=2 only applies to strategy=fsdp"),
    # unknown names
    (dict(algorithm__adv_estimator="grp"), "algorithm.adv_estimator='grp' is unknown (did you mean 'grpo'?)"),
    (dict(actor_rollout_ref__actor__kl_loss_type="k4"), "actor_rollout_ref.actor.kl_loss_type='k4' is unknown"),
    (dict(algorithm__kl_penalty="lowvar_kl"), "algorithm.kl_penalty='lowvar_kl' is unknown (did you mean 'low_var_kl'?)"),
    (dict(algorithm__kl_ctrl__type="pid"), "algorithm.kl_ctrl.type='pid' is unknown"),
    (dict(actor_rollout_ref__actor__loss_agg_mode="seq-mean"), "actor_rollout_ref.actor.loss_agg_mode='seq-mean' is unknown"),
    (dict(actor_rollout_ref__actor__strategy="deepspeed"), "actor_rollout_ref.actor.strategy='deepspeed' is unknown"),
    (dict(critic__strategy="ddp"), "critic.strategy='ddp' is unknown"),
    (dict(actor_rollout_ref__rollout__name="sglang"), "actor_rollout_ref.rollout.name='sglang' is unknown"),
    (dict(trainer__logger=["console", "wandbb"]), "trainer.logger='wandbb' is unknown (did you mean 'wandb'?)"),
    (dict(trainer__logger=["console", "console"]), "trainer.logger=['console', 'console'] lists a logger twice"),
    (dict(trainer__placement="spread"), "trainer.placement='spread' is unknown"),
    (dict(trainer__device="tpu"), "trainer.device='tpu' is unknown"),
    (dict(actor_rollout_ref__actor__param_dtype="fp16"), "actor_rollout_ref.actor.param_dtype='fp16' is unknown"),
    # algorithm requirements
    (dict(actor_rollout_ref__rollout__n=1, actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=2),
     "algorithm.adv_estimator=grpo compares several responses per prompt: set actor_rollout_ref.rollout.n>=2"),
    (dict(algorithm__adv_estimator="rloo", actor_rollout_ref__rollout__n=1,
          actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=2), "actor_rollout_ref.rollout.n>=2"),
    (dict(actor_rollout_ref__rollout__temperature=0.0), "actor_rollout_ref.rollout.temperature=0"),
    (dict(algorithm__adv_estimator="gae", critic__enable=False), "algorithm.adv_estimator=gae needs a critic"),
    (dict(reward_model__enable=True), "reward_model.enable=true needs reward_model.model.path"),
    (dict(actor_rollout_ref__actor__use_dynamic_bsz=True, actor_rollout_ref__actor__ppo_max_token_len_per_gpu=20,
          data__max_prompt_length=16, data__max_response_length=8),
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20 must hold one whole sequence with use_dynamic_bsz: "
     "at least data.max_prompt_length + data.max_response_length = 24"),
    (dict(actor_rollout_ref__actor__use_dynamic_bsz=True, actor_rollout_ref__rollout__log_prob_max_token_len_per_gpu=10),
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=10 must hold one whole sequence"),
    (dict(trainer__critic_warmup=2), "trainer.critic_warmup=2 warms up a critic, but algorithm.adv_estimator=grpo runs none"),
    (dict(algorithm__adv_estimator="gae", trainer__critic_warmup=-1), "trainer.critic_warmup=-1 must be >= 0"),
    (dict(trainer__placement="separate", actor_rollout_ref__actor__use_kl_loss=False),
     "trainer.placement=separate but no critic, reference or reward model"),
    (dict(actor_rollout_ref__rollout__val_kwargs__n=4), "actor_rollout_ref.rollout.val_kwargs.n=4 with do_sample=false"),
    (dict(actor_rollout_ref__ref__strategy="megatron"),
     "actor_rollout_ref.ref.strategy=megatron differs from actor_rollout_ref.actor.strategy=fsdp"),
    (dict(actor_rollout_ref__rollout__val_kwargs__n=2, actor_rollout_ref__rollout__val_kwargs__do_sample=True),
     "actor_rollout_ref.rollout.val_kwargs.n=2 with temperature=0 samples one greedy response n times"),
    # value ranges
    (dict(actor_rollout_ref__actor__clip_ratio_c=1.0), "actor_rollout_ref.actor.clip_ratio_c=1.0 must be > 1"),
    (dict(actor_rollout_ref__rollout__top_p=0.0), "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
    (dict(algorithm__lam=1.5), "algorithm.lam=1.5 must be in [0, 1]"),
    (dict(trainer__save_freq=-2), "trainer.save_freq=-2 must be -1 or 0 (off) or a positive number of steps"),
    (dict(data__train_batch_size=0), "data.train_batch_size=0 must be a positive integer"),
    (dict(actor_rollout_ref__actor__optim__lr=0.0), "actor_rollout_ref.actor.optim.lr=0.0 must be > 0"),
    (dict(trainer__init_timeout_s=0.0), "trainer.init_timeout_s=0.0 must be > 0"),
    (dict(algorithm__kl_ctrl__type="adaptive", algorithm__kl_ctrl__horizon=0),
     "algorithm.kl_ctrl.horizon=0 must be a positive integer"),
    (dict(data__train_max_samples=0), "data.train_max_samples=0 must be -1 (all) or a positive number"),
    # vLLM's scheduler, before any worker starts (prompt 32 + response 16 tokens)
    (dict(actor_rollout_ref__rollout__enable_chunked_prefill=False,
          actor_rollout_ref__rollout__max_num_batched_tokens=40),
     "max_num_batched_tokens=40 with enable_chunked_prefill=false cannot hold one sequence of"),
    (dict(actor_rollout_ref__rollout__max_num_batched_tokens=64),
     "max_num_batched_tokens=64 must be >= actor_rollout_ref.rollout.max_num_seqs=256"),
    # verl keys accepted for their "off" value only, and verl's reward managers
    (dict(actor_rollout_ref__actor__ulysses_sequence_parallel_size=2),
     "ulysses_sequence_parallel_size=2: Ulysses sequence parallelism is not implemented; set it to 1"),
    (dict(trainer__default_hdfs_dir="hdfs://x"), "trainer.default_hdfs_dir='hdfs://x': HDFS upload is not"),
    (dict(actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__actor__strategy="megatron"),
     "model.lora_rank=8: LoRA adapters are implemented for actor_rollout_ref.actor.strategy=fsdp"),
    (dict(actor_rollout_ref__model__lora_alpha=0.0), "actor_rollout_ref.model.lora_alpha"),
    (dict(critic__model__lora_rank=4, critic__strategy="megatron"),
     "critic.model.lora_rank=4: LoRA adapters are implemented for critic.strategy=fsdp"),
    (dict(critic__model__lora_rank=-1), "critic.model.lora_rank=-1 must be >= 0"),
    (dict(actor_rollout_ref__rollout__response_length=64, data__max_response_length=16),
     "rollout.response_length=64 differs from data.max_response_length=16: hybridflow reads the data key"),
    (dict(actor_rollout_ref__actor__checkpoint__save_contents=["model", "hf_model"]),
     "actor.checkpoint.save_contents=['model', 'hf_model'] leaves out ['optimizer', 'extra']"),
    (dict(critic__checkpoint__load_contents=["model", "optimizer", "extra", "weights"]),
     "critic.checkpoint.load_contents names ['weights']: use some of"),
    (dict(actor_rollout_ref__model__use_fused_kernels=True), "model.use_fused_kernels=true: these kernels"),
    (dict(actor_rollout_ref__model__trust_remote_code=True), "model.trust_remote_code=true: remote model code"),
    (dict(actor_rollout_ref__actor__policy_loss__loss_mode="clip_cov"),
     "actor.policy_loss.loss_mode='clip_cov' is unknown"),
    (dict(actor_rollout_ref__actor__optim__warmup_style="linear"), "actor.optim.warmup_style='linear' is unknown"),
    (dict(actor_rollout_ref__actor__optim__lr_scheduler_type="linear"), "actor.optim.lr_scheduler_type='linear' is unknown"),
    (dict(actor_rollout_ref__actor__optim__lr_scheduler=""), "actor.optim.lr_scheduler='' is unknown"),
    (dict(actor_rollout_ref__rollout__mode="async"), "actor_rollout_ref.rollout.mode='async': only sync"),
    (dict(reward_model__reward_manager="prime"), "reward_model.reward_manager='prime' is unknown"),
    (dict(reward_model__reward_manager="batch"), "reward_model.reward_manager=batch calls custom_reward_function"),
    (dict(trainer__val_only=True, data__val_files=[]), "trainer.val_only=true needs data.val_files"),
    (dict(algorithm__filter_groups__enable=True, algorithm__filter_groups__metric="pass@k"),
     "algorithm.filter_groups.metric='pass@k' is unknown"),
    (dict(algorithm__adv_estimator="gae", actor_rollout_ref__rollout__n=1, algorithm__filter_groups__enable=True),
     "algorithm.filter_groups.enable=true compares the samples of a prompt: set actor_rollout_ref.rollout.n>=2"),
    (dict(data__gen_batch_size=24), "data.gen_batch_size=24 differs from data.train_batch_size=8, which only"),
    (dict(data__gen_batch_size=4, algorithm__filter_groups__enable=True),
     "data.gen_batch_size=4 must be >= data.train_batch_size=8"),
    (dict(algorithm__filter_groups__max_num_gen_batches=-1),
     "algorithm.filter_groups.max_num_gen_batches=-1 must be >= 0"),
    (dict(reward_model__overlong_buffer__enable=True, reward_model__overlong_buffer__len=8),
     "reward_model.overlong_buffer.enable=true is applied by the dapo reward manager"),
    (dict(reward_model__reward_manager="dapo", reward_model__overlong_buffer__enable=True),
     "reward_model.overlong_buffer.len=4096 must be in [1, data.max_response_length=16]"),
])
def test_rule_names_its_key(run_dir, overrides, needle):
    assert needle in error_of(grpo(**overrides))


def test_dynamic_bsz_replaces_the_micro_batch_row_rule(run_dir):
    """With use_dynamic_bsz the token budget cuts micro-batches: a row count that does not divide
    the rank's share is not an error (verl ignores ppo_micro_batch_size_per_gpu then)."""
    assert "ppo_micro_batch_size_per_gpu=3 must divide" in error_of(grpo(actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=3))
    validate(grpo(actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=3, actor_rollout_ref__actor__use_dynamic_bsz=True),
             available_slots=2)


def test_critic_batch_rules_use_the_critic_sizes(run_dir):
    cfg = grpo(algorithm__adv_estimator="gae", critic__ppo_micro_batch_size_per_gpu=3)
    assert "critic.ppo_micro_batch_size_per_gpu=3 must divide the 8 sequences each critic rank" in error_of(cfg)
    cfg = grpo(algorithm__adv_estimator="gae", critic__ppo_mini_batch_size=3)
    assert "must be a multiple of critic.ppo_mini_batch_size=3" in error_of(cfg)


def test_separate_pool_sizes_the_critic_world(run_dir):
    cfg = grpo(algorithm__adv_estimator="gae", trainer__placement="separate",
               trainer__separate_pool_gpus_per_node=1, critic__strategy="megatron",
               critic__megatron__tensor_model_parallel_size=2)
    msg = error_of(cfg)
    assert "critic.megatron (tensor x pipeline parallel): 1 workers cannot be split into tp*pp=2" in msg
    # on its own pool the critic may use a Megatron layout unlike the actor's
    validate(grpo(algorithm__adv_estimator="gae", trainer__placement="separate", trainer__separate_pool_gpus_per_node=2,
                  actor_rollout_ref__actor__strategy="megatron", critic__strategy="megatron",
                  critic__megatron__pipeline_model_parallel_size=2), available_slots=4)


def test_missing_files_are_named(run_dir):
    (run_dir / "data/arithmetic/val.parquet").unlink()
    cfg = grpo(custom_reward_function__path="my_reward.py", trainer__resume_mode="ckpt/global_step_3")
    msg = error_of(cfg)
    assert f"data.val_files[0]: {run_dir}/data/arithmetic/val.parquet is not an existing file" in msg
    assert "custom_reward_function.path:" in msg and "trainer.resume_mode:" in msg
    cfg = grpo(actor_rollout_ref__model__path="nowhere")
    assert "actor_rollout_ref.model.path:" in error_of(cfg)
    validate(cfg, check_paths=False, model_config=TINY_MODEL)  # a dry run skips files


def test_model_shapes_must_split_over_tp_and_pp(run_dir):
    cfg = grpo(trainer__n_gpus_per_node=8, actor_rollout_ref__actor__strategy="megatron",
               actor_rollout_ref__actor__megatron__tensor_model_parallel_size=4,
               actor_rollout_ref__actor__megatron__pipeline_model_parallel_size=2,
               actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=1)
    msg = error_of(cfg, model_config=dict(TINY_MODEL, num_hidden_layers=3))
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 must divide the model's num_key_value_heads=2" in msg
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 must divide the model's vocab_size=66" in msg
    assert "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 must divide the model's num_hidden_layers=3" in msg
    assert "num_attention_heads=4" not in msg


def test_megatron_refuses_a_model_it_cannot_build_before_ray_starts(run_dir):
    cfg = grpo(actor_rollout_ref__actor__strategy="megatron")
    for family in ("llama", "qwen3", "mistral"):  # the block the engine builds, with their differences
        validate(cfg, model_config=dict(TINY_MODEL, model_type=family))
    msg = error_of(cfg, model_config=dict(TINY_MODEL, model_type="gemma2", architectures=["Gemma2ForCausalLM"]))
    assert msg.startswith("actor_rollout_ref.actor.strategy=megatron: model architecture 'Gemma2ForCausalLM' is "
                          "not supported by the megatron engine: use one of LlamaForCausalLM, Qwen2ForCausalLM, "
                          "Qwen3ForCausalLM, MistralForCausalLM (or strategy=fsdp)")
    windowed = dict(TINY_MODEL, model_type="mistral", sliding_window=256)
    assert "MistralForCausalLM with sliding_window=256 (below max_position_embeddings=512)" in error_of(
        cfg, model_config=windowed)
    assert "Qwen3ForCausalLM with attention_bias/mlp_bias=true" in error_of(
        cfg, model_config=dict(TINY_MODEL, model_type="qwen3", attention_bias=True))
    validate(grpo(), model_config=windowed)  # FSDP runs any HF causal LM
    # a critic from a checkpoint of its own is read and checked too
    critic = run_dir / "gemma_critic"
    critic.mkdir()
    (critic / "config.json").write_text(json.dumps(dict(TINY_MODEL, model_type="gemma2")))
    ppo = grpo(algorithm__adv_estimator="gae", critic__strategy="megatron", critic__model__path=str(critic),
               critic__ppo_micro_batch_size_per_gpu=2)
    assert error_of(ppo).startswith("critic.strategy=megatron: model architecture 'gemma2' is not supported")


def test_vllm_on_cpu_refuses_a_mixture_of_experts_model_before_ray_starts(run_dir):
    moe = dict(TINY_MODEL, model_type="mixtral", num_local_experts=4)
    msg = error_of(grpo(trainer__device="cpu"), model_config=moe)
    assert msg.startswith("actor_rollout_ref.rollout.name=vllm cannot update a mixture-of-experts model on CPU "
                          "(4 experts;"), msg
    assert msg.endswith("use actor_rollout_ref.rollout.name=hf on CPU, or a GPU")
    validate(grpo(trainer__device="cpu", actor_rollout_ref__rollout__name="hf"), model_config=moe)
    validate(grpo(trainer__device="cpu"), model_config=TINY_MODEL)  # dense: vLLM's reload works


def test_vllm_on_cpu_refuses_a_head_size_it_has_no_kernel_for(run_dir):
    narrow = dict(TINY_MODEL, hidden_size=4 * 16)  # 4 heads of 16
    msg = error_of(grpo(trainer__device="cpu"), model_config=narrow)
    assert msg.startswith("actor_rollout_ref.rollout.name=vllm on CPU has no attention kernel for the model's "
                          "head size 16 (supported: 32, 64,"), msg
    validate(grpo(trainer__device="cpu", actor_rollout_ref__rollout__name="hf"), model_config=narrow)
    validate(grpo(trainer__device="cpu"), model_config=dict(narrow, head_dim=32))  # Qwen3-style head_dim


def test_a_reward_model_must_be_a_one_label_classifier_on_the_actors_vocabulary(run_dir):
    rm = run_dir / "rm"
    rm.mkdir()

    def error_for(**config):
        (rm / "config.json").write_text(json.dumps({**TINY_MODEL, **config}))
        return error_of(grpo(reward_model__enable=True, reward_model__model__path=str(rm)))

    assert "holds a Qwen2ForCausalLM, not a sequence-classification model" in error_for(
        architectures=["Qwen2ForCausalLM"], id2label={"0": "LABEL_0"})
    cls = ["Qwen2ForSequenceClassification"]
    assert "a reward model needs num_labels=1, its config has 2" in error_for(architectures=cls)
    assert "vocab 32 differs from the actor's 66" in error_for(architectures=cls, id2label={"0": "x"}, vocab_size=32)
    (rm / "config.json").write_text(json.dumps({**TINY_MODEL, "architectures": cls, "id2label": {"0": "x"}}))
    validate(grpo(reward_model__enable=True, reward_model__model__path=str(rm)))


def test_the_cpu_head_sizes_mirror_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from hybridflow.model_checks import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_rollout_tp_and_kv_heads_must_divide_one_another(run_dir):
    cfg = grpo(trainer__n_gpus_per_node=4, actor_rollout_ref__rollout__tensor_model_parallel_size=4,
               actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=4)
    validate(cfg)  # 2 kv heads replicated over tp 4 is fine for vLLM
    msg = error_of(cfg, model_config=dict(TINY_MODEL, num_attention_heads=12, num_key_value_heads=3))
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4 and the model's num_key_value_heads=3" in msg


def test_sequence_lengths_must_fit_the_model(run_dir):
    cfg = grpo(data__max_prompt_length=500, data__max_response_length=16)
    assert "data.max_prompt_length + data.max_response_length = 516 exceeds" in error_of(cfg)
    cfg = grpo(actor_rollout_ref__rollout__max_model_len=1024)
    assert error_of(cfg).startswith("actor_rollout_ref.rollout.max_model_len=1024 exceeds the model's 512 "
                                    "positions (max_position_embeddings=512)")
    validate(grpo(actor_rollout_ref__rollout__max_model_len=512))


def test_more_workers_than_slots(run_dir):
    cfg = grpo(trainer__n_gpus_per_node=4)
    assert "the run needs 4 workers (trainer.nnodes*trainer.n_gpus_per_node=1*4)" in error_of(cfg, available_slots=2)
    cfg = grpo(trainer__placement="separate", trainer__separate_pool_gpus_per_node=1)
    assert "+ trainer.nnodes*trainer.separate_pool_gpus_per_node=1" in error_of(cfg, available_slots=2)
    if device_count() == 0:  # on CPU the message also says how to share the cores (2 slots x 1.0 CPU / 3)
        assert error_of(cfg, available_slots=2).endswith("or share the cores: trainer.cpus_per_worker=0.66")


def test_the_reward_models_own_pool_is_checked_and_counted(run_dir):
    """verl's reward_model.enable_resource_pool: nnodes x n_gpus_per_node more slots."""
    rm = dict(reward_model__enable=True, reward_model__enable_resource_pool=True,
              reward_model__model__path="data/models/tiny-qwen2-sft")
    assert "reward_model.n_gpus_per_node=0 must be" in error_of(grpo(**rm), check_paths=False)
    cfg = grpo(**rm, reward_model__n_gpus_per_node=1, reward_model__nnodes=1)
    msg = error_of(cfg, available_slots=2, check_paths=False)
    assert "the run needs 3 workers" in msg and "+ reward_model.nnodes*reward_model.n_gpus_per_node=1" in msg
    validate(cfg, available_slots=3, check_paths=False)
    cfg = grpo(reward_model__enable_resource_pool=True, reward_model__n_gpus_per_node=1, reward_model__nnodes=1)
    assert "reward_model.enable=false: set reward_model.enable=true" in error_of(cfg, check_paths=False)


@pytest.mark.skipif(device_count() > 0, reason="needs a machine without a visible GPU")
def test_cuda_requested_without_gpu(run_dir):
    assert "trainer.device=cuda but no GPU is visible" in error_of(grpo(trainer__device="cuda"))


def test_kl_in_loss_and_reward_is_allowed_with_a_warning(run_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.validate"):
        validate(grpo(algorithm__use_kl_in_reward=True))
    assert "penalised twice" in caplog.text


def test_a_reward_function_beside_a_reward_model_is_warned_unused(run_dir, caplog):
    rm = run_dir / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({**TINY_MODEL, "architectures": ["Qwen2ForSequenceClassification"],
                                                "id2label": {"0": "x"}}))
    fn = run_dir / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.validate"):
        validate(grpo(reward_model__enable=True, reward_model__model__path=str(rm),
                      custom_reward_function__path=str(fn)))
    assert "custom_reward_function.path is not called" in caplog.text


def test_zero_frequencies_mean_off_as_in_verl(run_dir):
    validate(grpo(trainer__test_freq=0, trainer__save_freq=0))  # the trainer runs neither at <= 0


def test_a_micro_batch_larger_than_a_ranks_share_is_one_micro_batch(run_dir):
    """ppo's defaults (mini-batch 4 prompts x n=1, micro-batch 4) on 2 workers: 2 sequences per rank."""
    validate(grpo(actor_rollout_ref__rollout__n=1, algorithm__adv_estimator="reinforce_plus_plus",
                  actor_rollout_ref__actor__ppo_mini_batch_size=4, actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=4))


def test_a_frozen_reference_may_rest_in_host_memory_unsharded(run_dir):
    """Only a trained role has DDP's gradient buckets; the reference with fsdp_size=1 has none."""
    validate(grpo(actor_rollout_ref__ref__fsdp_config__fsdp_size=1,
                  actor_rollout_ref__ref__fsdp_config__param_offload=True))


def test_remax_runs_with_one_sample(run_dir):
    cfg = grpo(algorithm__adv_estimator="remax", actor_rollout_ref__rollout__n=1,
               actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=2)
    validate(cfg)
    assert not derive(cfg).use_critic


def test_warmup_and_total_steps_follow_the_run_length(run_dir):
    cfg = grpo(trainer__total_epochs=2, actor_rollout_ref__actor__optim__lr_warmup_steps_ratio=0.1,
               actor_rollout_ref__actor__ppo_epochs=2)
    d = derive(cfg, dataset_len=40)
    assert (d.steps_per_epoch, d.total_training_steps) == (5, 10)
    assert d.actor_optimizer_steps_per_step == 4  # 2 ppo epochs x 2 mini-batches
    assert d.actor_warmup_steps == 4  # 10% of 40 optimizer steps
    assert derive(grpo(trainer__total_training_steps=3), dataset_len=40).total_training_steps == 3


def test_a_hub_id_as_model_path_says_to_download_it(run_dir):
    cfg = grpo(actor_rollout_ref__model__path="Qwen/Qwen2.5-0.5B-Instruct")
    msg = error_of(cfg)
    assert (f"actor_rollout_ref.model.path: {run_dir}/Qwen/Qwen2.5-0.5B-Instruct is not an existing directory: fix "
            "the path; if 'Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face Hub id, download it first (`hf download "
            "Qwen/Qwen2.5-0.5B-Instruct --local-dir <folder>`) and pass that folder") in msg


def test_gradient_checkpointing_says_it_turns_prompt_sharing_off(run_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.validate"):
        validate(grpo(actor_rollout_ref__model__enable_gradient_checkpointing=True))
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=true turns off" in caplog.text
    assert "critic.model" not in caplog.text  # GRPO trains no critic


def test_an_external_lib_may_register_an_advantage_estimator(run_dir, monkeypatch):
    """model.external_lib is imported before the names are checked, so a user's module can add
    an estimator (or a policy loss) by config alone."""
    from hybridflow.algorithms import ADVANTAGE_ESTIMATORS

    (run_dir / "my_estimators.py").write_text(
        "from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, grpo\n"
        "ADVANTAGE_ESTIMATORS['my_grpo'] = AdvantageEstimator('my_grpo', grpo, needs_groups=True)\n")
    monkeypatch.syspath_prepend(str(run_dir))
    monkeypatch.delitem(ADVANTAGE_ESTIMATORS, "my_grpo", raising=False)
    assert "algorithm.adv_estimator='my_grpo'" in error_of(grpo(algorithm__adv_estimator="my_grpo"))
    try:
        validate(grpo(algorithm__adv_estimator="my_grpo", actor_rollout_ref__model__external_lib="my_estimators"))
    finally:
        ADVANTAGE_ESTIMATORS.pop("my_grpo", None)
