"""The engines' and the rollout's settings, built from a loaded config in this one place: the
arguments of ``workers.engines.config.EngineConfig`` (actor, reference, critic, the SFT model) and
of ``workers.rollout.base.RolloutConfig``. They are dicts, so reading them needs neither torch nor
the workers; ``recipes/build.py`` and ``recipes/main_sft.py`` hand them to the worker classes."""
from __future__ import annotations

import dataclasses

from hybridflow.config.derived import (
    Derived, critic_shares_actor_model, log_prob_token_budget, lora_kwargs, model_parallel, warmup_steps,
)
from hybridflow.config.root import RootConfig


def fsdp_kwargs(fsdp_config) -> dict:
    return dict(fsdp_size=fsdp_config.fsdp_size, forward_prefetch=fsdp_config.forward_prefetch,
                reshard_after_forward=fsdp_config.reshard_after_forward)


def offload_kwargs(strategy: str, fsdp_config, megatron) -> dict:
    """verl's ``param_offload`` / ``optimizer_offload``, read from the strategy's own node."""
    node = megatron if strategy == "megatron" else fsdp_config
    return dict(param_offload=node.param_offload, optimizer_offload=getattr(node, "optimizer_offload", False))


def _trained_engine_kwargs(strategy: str, param_dtype: str, optim, model, fsdp_config, megatron,
                           total_steps: int, warmup: int | None) -> dict:
    """What every trained engine (actor, critic, SFT model) reads alike from its strategy, optimizer,
    model section and parallel nodes; ``total_steps``: its optimizer steps over the run."""
    tp, pp = model_parallel(strategy, megatron)
    return dict(
        strategy=strategy, tp=tp, pp=pp, param_dtype=param_dtype, lr=optim.lr, weight_decay=optim.weight_decay,
        betas=tuple(optim.betas), adam_eps=optim.eps, warmup_steps=warmup or 0, lr_schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio, total_steps=total_steps, grad_clip=optim.clip_grad,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        **fsdp_kwargs(fsdp_config), **offload_kwargs(strategy, fsdp_config, megatron), **lora_kwargs(model))


def _rl_engine_kwargs(cfg: RootConfig, d: Derived, role, model, fsdp_config, steps_per_step: int, warmup) -> dict:
    """The actor's and the critic's, from their own section (``role``), its model section and its
    ``fsdp_config``; ``steps_per_step``: its optimizer steps per training step."""
    return _trained_engine_kwargs(role.strategy, role.param_dtype, role.optim, model, fsdp_config, role.megatron,
                                  (d.total_training_steps or 0) * steps_per_step, warmup) | dict(
        grad_clip=role.optim.clip_grad if role.grad_clip is None else role.grad_clip,  # verl has both keys
        micro_batch_size_per_gpu=role.ppo_micro_batch_size_per_gpu,
        max_token_len_per_gpu=role.ppo_max_token_len_per_gpu if role.use_dynamic_bsz else None,
        use_remove_padding=model.use_remove_padding, share_prompt_prefix=model.share_prompt_prefix,
        group_by_length=model.group_by_length, seed=cfg.trainer.seed)


def actor_engine_kwargs(cfg: RootConfig, derived: Derived) -> dict:
    arr, d = cfg.actor_rollout_ref, derived
    return _rl_engine_kwargs(cfg, d, arr.actor, arr.model, arr.actor.fsdp_config,
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


def critic_override_config(cfg: RootConfig) -> dict:
    """``critic.model.override_config``, or the actor's when the critic starts from the actor's
    model and sets none. verl reads only the critic's own key (its default is empty); here a
    critic built from the actor's checkpoint sees the model the actor trains (rope scaling, context
    length, norms) unless it says otherwise, which is what a user who overrides the actor means."""
    own = cfg.critic.model.override_config
    return dict(cfg.actor_rollout_ref.model.override_config if not own and critic_shares_actor_model(cfg) else own)


def critic_engine_kwargs(cfg: RootConfig, derived: Derived) -> dict:
    critic, d = cfg.critic, derived
    forward_budget = critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu
    return _rl_engine_kwargs(cfg, d, critic, critic.model, critic.model.fsdp_config,
                             d.critic_optimizer_steps_per_step, d.critic_warmup_steps) | dict(
        infer_micro_batch_size_per_gpu=critic.forward_micro_batch_size_per_gpu,
        infer_max_token_len_per_gpu=forward_budget if critic.use_dynamic_bsz else None,
        override_config=critic_override_config(cfg),
        # the fused update runs the critic's pipeline the other way (workers/engines/megatron_fused.py)
        reverse_pipeline=cfg.stage_fusion.fuse_actor_critic_update)


def sft_engine_kwargs(sft, total_steps: int) -> dict:
    """The SFT model's (``SFTConfig``); ``total_steps``: optimizer steps over the run."""
    m = sft.model
    return _trained_engine_kwargs(m.strategy, m.param_dtype, sft.optim, m, m.fsdp_config, m.megatron, total_steps,
                                  warmup_steps(sft.optim, total_steps)) | dict(
        micro_batch_size_per_gpu=sft.data.micro_batch_size_per_gpu, seed=sft.trainer.seed,
        disable_dropout=False)  # SFT trains with the checkpoint's dropout, as verl's does


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
        vllm_engine_kwargs=_vllm_engine_kwargs(r), free_cache_engine=r.free_cache_engine, seed=cfg.trainer.seed,
        hf_overrides=dict(cfg.actor_rollout_ref.model.override_config),  # vLLM builds the actor's model
        speculative=dataclasses.asdict(r.speculative), multi_turn=multi_turn_settings(cfg))


def _vllm_engine_kwargs(r) -> dict:
    """``rollout.engine_kwargs.vllm``, plus the priority policy that reallocation's
    ``adopted_first`` starts moved samples with (equal priorities keep first come, first served)."""
    kwargs = dict(r.engine_kwargs.vllm)
    if r.reallocation.enable and r.reallocation.adopted_first:
        kwargs.setdefault("scheduling_policy", "priority")
    return kwargs


def multi_turn_settings(cfg: RootConfig) -> dict:
    """``rollout.multi_turn`` for the rollout's agent loops (workers/rollout/vllm_agent.py), with what
    they need beside it: the default loop, the tokenizer (its chat template renders the turns) and
    the data's chat-template arguments. Empty when off."""
    r, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    if not r.multi_turn.enable:
        return {}
    return dict(dataclasses.asdict(r.multi_turn), default_agent_loop=r.agent.default_agent_loop,
                tokenizer_path=model.tokenizer_path or model.path, chat_template=model.custom_chat_template,
                apply_chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs or {}))
