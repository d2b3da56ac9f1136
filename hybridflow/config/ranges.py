"""Single-key value ranges: positive sizes, probabilities in (0, 1], coefficients >= 0.

Kept apart from ``validate.py`` because it is a table, not logic: one row per key.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from hybridflow.config.common import MegatronConfig, OptimConfig
from hybridflow.config.root import RootConfig

Check = tuple[str, Any, Callable[[Any], bool], str]  # key, value, ok(value), what it must be

POSITIVE = (lambda v: v >= 1, "a positive integer")
OPTIONAL_POSITIVE = (lambda v: v is None or v >= 1, "null or a positive integer")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
GREATER_THAN_0 = (lambda v: v > 0, "> 0")
OPTIONAL_GT_0 = (lambda v: v is None or v > 0, "null or > 0")
UNIT = (lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN_UNIT = (lambda v: 0 < v <= 1, "in (0, 1]")
# verl reads any frequency <= 0 as off; -1 is the documented spelling, 0 is accepted as well
FREQ = (lambda v: v >= -1, "-1 or 0 (off) or a positive number of steps")
MAX_SAMPLES = (lambda v: v == -1 or v >= 1, "-1 (all) or a positive number of prompts")
TOP_K = (lambda v: v == -1 or v >= 1, "-1 (off) or a positive integer")


def _row(key: str, value: Any, rule: tuple) -> Check:
    return key, value, rule[0], rule[1]


def optim_rows(key: str, o: OptimConfig) -> list[Check]:
    return [
        _row(f"{key}.lr", o.lr, GREATER_THAN_0),
        _row(f"{key}.weight_decay", o.weight_decay, NON_NEGATIVE),
        (f"{key}.betas", o.betas, lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
         "two numbers in [0, 1), e.g. [0.9, 0.999]"),
        _row(f"{key}.eps", o.eps, GREATER_THAN_0),
        (f"{key}.lr_warmup_steps", o.lr_warmup_steps, lambda v: v >= -1,
         "-1 (use lr_warmup_steps_ratio) or a step count >= 0"),
        (f"{key}.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio, lambda v: 0 <= v < 1, "in [0, 1)"),
        _row(f"{key}.min_lr_ratio", o.min_lr_ratio, UNIT),
    ]


def _megatron_rows(key: str, m: MegatronConfig) -> list[Check]:
    return [_row(f"{key}.tensor_model_parallel_size", m.tensor_model_parallel_size, POSITIVE),
            _row(f"{key}.pipeline_model_parallel_size", m.pipeline_model_parallel_size, POSITIVE)]


def non_finite_errors(node: Any, key: str = "") -> list[str]:
    """Every float in the config tree (dataclass fields, lists, dicts such as override_config) must
    be finite: ``lr=inf`` passes ``> 0`` and trains on NaN, and NaN fails every comparison only where
    a row happens to check the key. One walk covers keys no row names."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    elif isinstance(node, float) and not math.isfinite(node):
        return [f"{key}={node!r} must be a finite number, not inf or nan"]
    else:
        return []
    return [e for name, value in items for e in non_finite_errors(value, _child_key(key, name))]


def _child_key(key: str, name: str) -> str:
    """``critic.optim`` + ``lr`` -> ``critic.optim.lr``; ``critic.optim.betas`` + ``[1]`` ->
    ``critic.optim.betas[1]``."""
    return name if not key else f"{key}{name}" if name.startswith("[") else f"{key}.{name}"


def range_errors(cfg: RootConfig) -> list[str]:
    d, arr, c, t, alg = cfg.data, cfg.actor_rollout_ref, cfg.critic, cfg.trainer, cfg.algorithm
    a, r, v = arr.actor, arr.rollout, arr.rollout.val_kwargs
    A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    rows: list[Check] = [
        _row("data.max_prompt_length", d.max_prompt_length, POSITIVE),
        _row("data.max_response_length", d.max_response_length, POSITIVE),
        _row("data.train_batch_size", d.train_batch_size, POSITIVE),
        _row("data.val_batch_size", d.val_batch_size, OPTIONAL_POSITIVE),
        _row("data.gen_batch_size", d.gen_batch_size, OPTIONAL_POSITIVE),
        _row("data.train_max_samples", d.train_max_samples, MAX_SAMPLES),
        _row("data.val_max_samples", d.val_max_samples, MAX_SAMPLES),
        ("data.prompt_key", d.prompt_key, bool, "a column name"),
        _row(f"{A}.ppo_mini_batch_size", a.ppo_mini_batch_size, POSITIVE),
        _row(f"{A}.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, POSITIVE),
        _row(f"{A}.ppo_epochs", a.ppo_epochs, POSITIVE),
        _row(f"{A}.clip_ratio", a.clip_ratio, GREATER_THAN_0),
        _row(f"{A}.clip_ratio_low", a.clip_ratio_low, OPTIONAL_GT_0),
        _row(f"{A}.clip_ratio_high", a.clip_ratio_high, OPTIONAL_GT_0),
        # Dual-clip (Ye et al. 2020, eq. 5) bounds the ratio for negative advantages at c > 1.
        (f"{A}.clip_ratio_c", a.clip_ratio_c, lambda x: x > 1, "> 1 (the dual-clip bound)"),
        _row(f"{A}.entropy_coeff", a.entropy_coeff, NON_NEGATIVE),
        _row("actor_rollout_ref.model.lora_rank", arr.model.lora_rank, NON_NEGATIVE),
        _row("actor_rollout_ref.model.lora_alpha", arr.model.lora_alpha, GREATER_THAN_0),
        _row(f"{A}.kl_loss_coef", a.kl_loss_coef, NON_NEGATIVE),
        *optim_rows(f"{A}.optim", a.optim),
        *_megatron_rows(f"{A}.megatron", a.megatron),
        _row(f"{R}.n", r.n, POSITIVE),
        _row(f"{R}.temperature", r.temperature, NON_NEGATIVE),
        _row(f"{R}.top_p", r.top_p, OPEN_UNIT),
        _row(f"{R}.top_k", r.top_k, TOP_K),
        _row(f"{R}.tensor_model_parallel_size", r.tensor_model_parallel_size, POSITIVE),
        _row(f"{R}.gpu_memory_utilization", r.gpu_memory_utilization, OPEN_UNIT),
        _row(f"{R}.kv_cache_gib", r.kv_cache_gib, GREATER_THAN_0),
        _row(f"{R}.max_num_seqs", r.max_num_seqs, POSITIVE),
        _row(f"{R}.max_num_batched_tokens", r.max_num_batched_tokens, OPTIONAL_POSITIVE),
        _row(f"{R}.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes, POSITIVE),
        _row(f"{R}.log_prob_micro_batch_size_per_gpu", r.log_prob_micro_batch_size_per_gpu, POSITIVE),
        _row(f"{R}.val_kwargs.n", v.n, POSITIVE),
        _row(f"{R}.val_kwargs.temperature", v.temperature, NON_NEGATIVE),
        _row(f"{R}.val_kwargs.top_p", v.top_p, OPEN_UNIT),
        _row(f"{R}.val_kwargs.top_k", v.top_k, TOP_K),
        _row("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
             arr.ref.log_prob_micro_batch_size_per_gpu, POSITIVE),
        _row("critic.ppo_mini_batch_size", c.ppo_mini_batch_size, OPTIONAL_POSITIVE),
        _row("critic.ppo_micro_batch_size_per_gpu", c.ppo_micro_batch_size_per_gpu, POSITIVE),
        _row("critic.forward_micro_batch_size_per_gpu", c.forward_micro_batch_size_per_gpu, OPTIONAL_POSITIVE),
        _row("critic.ppo_max_token_len_per_gpu", c.ppo_max_token_len_per_gpu, POSITIVE),
        _row("critic.forward_max_token_len_per_gpu", c.forward_max_token_len_per_gpu, OPTIONAL_POSITIVE),
        _row("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu, POSITIVE),
        _row("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", r.log_prob_max_token_len_per_gpu,
             OPTIONAL_POSITIVE),
        _row("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_max_token_len_per_gpu,
             OPTIONAL_POSITIVE),
        _row("critic.ppo_epochs", c.ppo_epochs, OPTIONAL_POSITIVE),
        _row("critic.cliprange_value", c.cliprange_value, GREATER_THAN_0),
        _row("critic.model.lora_rank", c.model.lora_rank, NON_NEGATIVE),
        _row("critic.model.lora_alpha", c.model.lora_alpha, GREATER_THAN_0),
        *optim_rows("critic.optim", c.optim),
        *_megatron_rows("critic.megatron", c.megatron),
        _row("reward_model.micro_batch_size_per_gpu", cfg.reward_model.micro_batch_size_per_gpu, POSITIVE),
        ("custom_reward_function.name", cfg.custom_reward_function.name, bool, "a function name"),
        _row("custom_reward_function.timeout_s", cfg.custom_reward_function.timeout_s, OPTIONAL_GT_0),
        _row("algorithm.gamma", alg.gamma, UNIT),
        _row("algorithm.lam", alg.lam, UNIT),
        _row("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef, NON_NEGATIVE),
        _row("algorithm.filter_groups.max_num_gen_batches", alg.filter_groups.max_num_gen_batches, NON_NEGATIVE),
        _row("trainer.nnodes", t.nnodes, POSITIVE),
        _row("trainer.n_gpus_per_node", t.n_gpus_per_node, POSITIVE),
        _row("trainer.total_epochs", t.total_epochs, POSITIVE),
        _row("trainer.total_training_steps", t.total_training_steps, OPTIONAL_POSITIVE),
        _row("trainer.save_freq", t.save_freq, FREQ),
        _row("trainer.critic_warmup", t.critic_warmup, NON_NEGATIVE),
        _row("trainer.log_val_generations", t.log_val_generations, NON_NEGATIVE),
        _row("trainer.test_freq", t.test_freq, FREQ),
        _row("trainer.max_actor_ckpt_to_keep", t.max_actor_ckpt_to_keep, OPTIONAL_POSITIVE),
        _row("trainer.max_critic_ckpt_to_keep", t.max_critic_ckpt_to_keep, OPTIONAL_POSITIVE),
        _row("trainer.call_timeout_s", t.call_timeout_s, GREATER_THAN_0),
        _row("trainer.init_timeout_s", t.init_timeout_s, GREATER_THAN_0),
        _row("trainer.separate_pool_gpus_per_node", t.separate_pool_gpus_per_node, POSITIVE),
        _row("trainer.cpus_per_worker", t.cpus_per_worker, GREATER_THAN_0),
        _row("ray_init.num_cpus", cfg.ray_init.num_cpus, OPTIONAL_POSITIVE),
    ]
    if cfg.reward_model.enable_resource_pool:  # the reward model's own pool: nnodes x n_gpus_per_node slots
        rows += [_row("reward_model.n_gpus_per_node", cfg.reward_model.n_gpus_per_node, POSITIVE),
                 _row("reward_model.nnodes", cfg.reward_model.nnodes, POSITIVE)]
    if alg.kl_ctrl.type == "adaptive":  # Ziegler et al. (2019) eq. 2 divides by both
        rows += [_row("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl, GREATER_THAN_0),
                 _row("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon, POSITIVE)]
    return row_errors(rows, non_finite_errors(cfg))


def row_errors(rows: list[Check], non_finite: list[str]) -> list[str]:
    """The non-finite values' messages, then each failing row's; a key named by the first is not
    repeated (nan also fails its range, but 'must be finite' is the message that says what is wrong)."""
    named = {e.split("=", 1)[0].split("[", 1)[0] for e in non_finite}  # betas[1] names betas
    return non_finite + [f"{key}={value!r} must be {what}" for key, value, ok, what in rows
                         if key not in named and not ok(value)]
