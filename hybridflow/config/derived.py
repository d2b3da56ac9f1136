"""Numbers the trainer derives from a config: parallel sizes, per-step batch counts, run length,
and the keyword arguments of the engine and rollout dataclasses (which live in ``workers/``, so
they are returned as dicts: the core never imports ``workers``).

Batch arithmetic is verl's: ``ppo_mini_batch_size`` counts prompts, so one mini-batch holds
``ppo_mini_batch_size * rollout.n`` sequences, split evenly over the data-parallel ranks, each
rank running ``ppo_micro_batch_size_per_gpu`` sequences per forward/backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.resolve import (  # noqa: F401 (estimator_needs_critic, say_once: importers of derived)
    estimator_needs_critic, needs_critic, needs_reference, resolve, say_once,
)
from hybridflow.config.root import RootConfig

# Mirrors of names owned by workers/ (tests check they stay equal to the workers' tuples).
STRATEGIES = ("fsdp", "megatron")
# verl names its FSDP2 engine "fsdp2" and its FSDP1 engine "fsdp"; the FSDP engine here is FSDP2,
# so both spellings select it
STRATEGY_ALIASES = {"fsdp2": "fsdp"}
PARAM_DTYPES = ("auto", "fp32", "bf16")  # auto: resolve.resolve_param_dtype
LR_SCHEDULERS = ("constant", "cosine")
ROLLOUT_NAMES = ("vllm", "hf")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def canonical_strategy(name):
    """The engine a strategy name selects (``fsdp2`` -> ``fsdp``); other names pass unchanged."""
    return STRATEGY_ALIASES.get(name, name)


def reward_pool_world(cfg: RootConfig) -> int:
    """Workers of the reward model's own pool (verl's ``reward_model.enable_resource_pool``); 0 when
    it shares a pool with other roles."""
    rm = cfg.reward_model
    return rm.nnodes * rm.n_gpus_per_node if rm.enable and rm.enable_resource_pool else 0


def reward_fn_runs_async(cfg: RootConfig) -> bool:
    """verl's ``reward_model.launch_reward_fn_async``, where it can apply: not with a reward model
    (itself a worker call) nor with dynamic sampling, which needs the scores at once."""
    return (cfg.reward_model.launch_reward_fn_async and not cfg.reward_model.enable
            and not cfg.algorithm.filter_groups.enable)


def critic_shares_actor_model(cfg: RootConfig) -> bool:
    """``critic.model.path`` null (or the actor's path): the critic's backbone is the actor's model."""
    return cfg.critic.model.path in (None, cfg.actor_rollout_ref.model.path)


def critic_override_config(cfg: RootConfig) -> dict:
    """``critic.model.override_config``, or the actor's when the critic starts from the actor's
    model and sets none. verl reads only the critic's own key (its default is empty); here a
    critic built from the actor's checkpoint sees the model the actor trains (rope scaling, context
    length, norms) unless it says otherwise, which is what a user who overrides the actor means."""
    own = cfg.critic.model.override_config
    return dict(cfg.actor_rollout_ref.model.override_config if not own and critic_shares_actor_model(cfg) else own)


def critic_external_lib(cfg: RootConfig) -> str | None:
    """``critic.model.external_lib``, or else the actor's, as in verl (a critic of its own
    checkpoint is usually of the actor's architecture, which the module registers)."""
    return cfg.critic.model.external_lib or cfg.actor_rollout_ref.model.external_lib


def reward_model_external_lib(cfg: RootConfig) -> str | None:
    """``reward_model.model.external_lib``, or else the actor's, as in verl."""
    return cfg.reward_model.model.external_lib or cfg.actor_rollout_ref.model.external_lib


def model_parallel(strategy: str, megatron) -> tuple[int, int]:
    """(tp, pp) a role trains with; fsdp shards data-parallel only."""
    if strategy == "megatron":
        return megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    return 1, 1


@dataclass(frozen=True)
class Derived:
    actor_world: int  # workers in the actor/rollout pool (= nnodes * n_gpus_per_node)
    actor_tp: int
    actor_pp: int
    actor_dp: int  # actor_world // (tp * pp)
    rollout_dp: int  # actor_world // rollout tp: generation engines
    critic_world: int  # workers hosting the critic (0 without one)
    critic_dp: int
    aux_world: int  # workers of the separate pool (0 when colocated)
    total_workers: int  # Ray worker processes the run starts
    use_critic: bool
    use_reference: bool
    use_reward_model: bool
    sequences_per_step: int  # train_batch_size * rollout.n
    actor_mini_batches_per_epoch: int  # optimizer steps per ppo epoch
    actor_micro_batches_per_mini: int  # gradient-accumulation steps per rank
    actor_optimizer_steps_per_step: int  # ppo_epochs * mini-batches
    critic_mini_batch_size: int  # prompts
    critic_ppo_epochs: int
    critic_optimizer_steps_per_step: int
    steps_per_epoch: int | None  # None when the data set length is unknown
    total_training_steps: int | None
    actor_warmup_steps: int | None
    critic_warmup_steps: int | None


def prompts_per_generation_batch(cfg: RootConfig) -> int:
    """What the training data loader yields at a time: ``data.gen_batch_size`` (dynamic sampling
    generates more than it trains on), else ``data.train_batch_size``."""
    return cfg.data.gen_batch_size or cfg.data.train_batch_size


def _total_steps(cfg: RootConfig, dataset_len: int | None) -> tuple[int | None, int | None]:
    per_epoch = None if dataset_len is None else dataset_len // prompts_per_generation_batch(cfg)
    if cfg.trainer.total_training_steps is not None:
        return per_epoch, cfg.trainer.total_training_steps
    return per_epoch, (None if per_epoch is None else per_epoch * cfg.trainer.total_epochs)


def _warmup(optim, total_optimizer_steps: int | None) -> int | None:
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    if total_optimizer_steps is None:
        return None if optim.lr_warmup_steps_ratio > 0 else 0
    return int(optim.lr_warmup_steps_ratio * total_optimizer_steps)


def derive(cfg: RootConfig, dataset_len: int | None = None) -> Derived:
    """Derived sizes; assumes ``validate(cfg)`` passed (divisions are exact there).

    ``dataset_len`` is the number of training prompts after filtering; the loader drops the last
    partial batch, so an epoch is ``dataset_len // train_batch_size`` steps. A config built in code
    rather than by ``load_config`` has its ``auto`` values resolved here (a loaded one has none left).
    """
    resolve(cfg)
    arr, tr = cfg.actor_rollout_ref, cfg.trainer
    n = arr.rollout.n
    world = tr.nnodes * tr.n_gpus_per_node
    tp, pp = model_parallel(arr.actor.strategy, arr.actor.megatron)
    use_critic = needs_critic(cfg)
    separate = tr.placement == "separate"
    aux_world = tr.nnodes * tr.separate_pool_gpus_per_node if separate else 0
    critic_world = (aux_world if separate else world) if use_critic else 0
    ctp, cpp = model_parallel(cfg.critic.strategy, cfg.critic.megatron)
    critic_dp = critic_world // (ctp * cpp) if critic_world else 0

    actor_dp = world // (tp * pp)
    mini_seqs_per_rank = arr.actor.ppo_mini_batch_size * n // actor_dp
    actor_minis = cfg.data.train_batch_size // arr.actor.ppo_mini_batch_size
    actor_opt_steps = arr.actor.ppo_epochs * actor_minis
    critic_mini = cfg.critic.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size
    critic_epochs = cfg.critic.ppo_epochs or arr.actor.ppo_epochs
    critic_opt_steps = critic_epochs * (cfg.data.train_batch_size // critic_mini) if use_critic else 0

    per_epoch, total = _total_steps(cfg, dataset_len)
    return Derived(
        actor_world=world, actor_tp=tp, actor_pp=pp, actor_dp=actor_dp,
        rollout_dp=world // arr.rollout.tensor_model_parallel_size,
        critic_world=critic_world, critic_dp=critic_dp, aux_world=aux_world,
        total_workers=world + aux_world,
        use_critic=use_critic, use_reference=needs_reference(cfg),
        use_reward_model=cfg.reward_model.enable,
        sequences_per_step=cfg.data.train_batch_size * n,
        actor_mini_batches_per_epoch=actor_minis,
        actor_micro_batches_per_mini=max(1, mini_seqs_per_rank // arr.actor.ppo_micro_batch_size_per_gpu),
        actor_optimizer_steps_per_step=actor_opt_steps,
        critic_mini_batch_size=critic_mini, critic_ppo_epochs=critic_epochs,
        critic_optimizer_steps_per_step=critic_opt_steps,
        steps_per_epoch=per_epoch, total_training_steps=total,
        actor_warmup_steps=_warmup(arr.actor.optim, None if total is None else total * actor_opt_steps),
        critic_warmup_steps=_warmup(cfg.critic.optim, None if total is None else total * critic_opt_steps),
    )


def _trained_engine_kwargs(cfg: RootConfig, d: Derived, role, model, fsdp_config, steps_per_step: int,
                           warmup) -> dict:
    """What the actor's and the critic's engines read alike from their own section (``role``), its
    model section and its ``fsdp_config``; ``steps_per_step``: its optimizer steps per training step."""
    tp, pp = model_parallel(role.strategy, role.megatron)
    optim = role.optim
    return dict(
        strategy=role.strategy, tp=tp, pp=pp, param_dtype=role.param_dtype, lr=optim.lr,
        weight_decay=optim.weight_decay, betas=tuple(optim.betas), adam_eps=optim.eps,
        warmup_steps=warmup or 0, lr_schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio,
        total_steps=(d.total_training_steps or 0) * steps_per_step,
        grad_clip=optim.clip_grad if role.grad_clip is None else role.grad_clip,  # verl has both keys
        micro_batch_size_per_gpu=role.ppo_micro_batch_size_per_gpu,
        max_token_len_per_gpu=role.ppo_max_token_len_per_gpu if role.use_dynamic_bsz else None,
        gradient_checkpointing=model.enable_gradient_checkpointing, use_remove_padding=model.use_remove_padding,
        share_prompt_prefix=model.share_prompt_prefix, seed=cfg.trainer.seed,
        **fsdp_kwargs(fsdp_config), **offload_kwargs(role.strategy, fsdp_config, role.megatron), **lora_kwargs(model))


def fsdp_kwargs(fsdp_config) -> dict:
    return dict(fsdp_size=fsdp_config.fsdp_size, forward_prefetch=fsdp_config.forward_prefetch,
                reshard_after_forward=fsdp_config.reshard_after_forward)


def offload_kwargs(strategy: str, fsdp_config, megatron) -> dict:
    """verl's ``param_offload`` / ``optimizer_offload``, read from the strategy's own node."""
    node = megatron if strategy == "megatron" else fsdp_config
    return dict(param_offload=node.param_offload, optimizer_offload=getattr(node, "optimizer_offload", False))


def log_prob_token_budget(cfg: RootConfig, section) -> int | None:
    """The token budget of a log-prob pass (``rollout`` or ``ref`` section, verl's
    ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu``; null follows the actor's
    ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``), or None for fixed-size micro-batches."""
    actor = cfg.actor_rollout_ref.actor
    use = actor.use_dynamic_bsz if section.log_prob_use_dynamic_bsz is None else section.log_prob_use_dynamic_bsz
    if not use:
        return None
    return section.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu


def lora_kwargs(model) -> dict:
    """verl's LoRA keys of a model section (``common.LoraKeys``) as EngineConfig arguments."""
    return dict(lora_rank=model.lora_rank, lora_alpha=model.lora_alpha, target_modules=list(model.target_modules),
                exclude_modules=list(model.exclude_modules) or None)


def actor_engine_kwargs(cfg: RootConfig, derived: Derived) -> dict:
    """Arguments of ``workers.engines.config.EngineConfig`` for the actor (the engines' settings are
    built here and in the two functions below, nowhere else)."""
    arr, d = cfg.actor_rollout_ref, derived
    return _trained_engine_kwargs(cfg, d, arr.actor, arr.model, arr.actor.fsdp_config,
                                  d.actor_optimizer_steps_per_step, d.actor_warmup_steps) | dict(
        infer_micro_batch_size_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=log_prob_token_budget(cfg, arr.rollout),
        override_config=dict(arr.model.override_config))


def ref_engine_kwargs(cfg: RootConfig, derived: Derived) -> dict:
    """The reference policy's: the actor's model and parallel sizes with the ``ref`` section's
    micro-batches, fsdp and offload keys, and no adapters (colocated with a LoRA actor, the worker
    uses the actor's engine with its adapters off instead of this one)."""
    ref, strategy = cfg.actor_rollout_ref.ref, cfg.actor_rollout_ref.actor.strategy
    return actor_engine_kwargs(cfg, derived) | dict(
        micro_batch_size_per_gpu=ref.log_prob_micro_batch_size_per_gpu,
        infer_micro_batch_size_per_gpu=ref.log_prob_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=log_prob_token_budget(cfg, ref), lora_rank=0,
        **fsdp_kwargs(ref.fsdp_config), **offload_kwargs(strategy, ref.fsdp_config, ref.megatron))


def critic_engine_kwargs(cfg: RootConfig, derived: Derived) -> dict:
    critic, d = cfg.critic, derived
    forward_budget = critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu
    return _trained_engine_kwargs(cfg, d, critic, critic.model, critic.model.fsdp_config,
                                  d.critic_optimizer_steps_per_step, d.critic_warmup_steps) | dict(
        infer_micro_batch_size_per_gpu=critic.forward_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=forward_budget if critic.use_dynamic_bsz else None,
        override_config=critic_override_config(cfg))


def rollout_engine_kwargs(cfg: RootConfig) -> dict:
    """Arguments of ``workers.rollout.base.RolloutConfig`` (prompt/response widths from data).

    verl's dummy_* load formats (dummy_dtensor, dummy_hf, dummy_megatron: named after the
    training backend that fills the weights) are all vLLM's "dummy" random init."""
    r = cfg.actor_rollout_ref.rollout
    return dict(
        name=r.name, n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample,
        ignore_eos=r.ignore_eos, max_model_len=r.max_model_len, tensor_model_parallel_size=r.tensor_model_parallel_size,
        prompt_length=cfg.data.max_prompt_length, response_length=cfg.data.max_response_length, dtype=r.dtype,
        gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib, max_num_seqs=r.max_num_seqs,
        cpu_live_weights=r.cpu_live_weights, max_num_batched_tokens=r.max_num_batched_tokens,
        enable_chunked_prefill=r.enable_chunked_prefill, enforce_eager=r.enforce_eager,
        enable_prefix_caching=r.enable_prefix_caching, disable_log_stats=r.disable_log_stats,
        load_format="dummy" if r.load_format.startswith("dummy") else r.load_format,
        vllm_engine_kwargs=dict(r.engine_kwargs.vllm), free_cache_engine=r.free_cache_engine, seed=cfg.trainer.seed,
        hf_overrides=dict(cfg.actor_rollout_ref.model.override_config))  # vLLM builds the actor's model
