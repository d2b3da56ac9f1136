"""verl compatibility, in one place, so verl's scripts and generated configs run unchanged: inert
keys, keys accepted at their "off" value only, verl's deprecated global micro-batch sizes, and verl's
other names and homes of a key. An inert key has no effect here: it is listed with the values it is
accepted at (``ANY``: every value) and what it is; another value fails before any worker starts. No
code reads these keys, so they are not dataclass fields: ``load.to_dataclass`` removes them
(:func:`pop_inert_keys`), ``recipes/cli.py`` lets Hydra add them without a ``+``. A schema names its
table in ``verl_inert_keys``.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from hybridflow.errors import ConfigError

# verl's name of the hybrid worker's section, spelled here too: this module imports nothing of
# hybridflow.config, which reads verl's keys through it before its own tree exists
ARR = "actor_rollout_ref"

logger = logging.getLogger(__name__)


ANY, OFF, NULL = None, (False,), (None,)
SPEED, MEMORY = "speed only", "memory only"
NO_REMOTE_CODE = "remote model code is never run"
NO_LIGER = (OFF, "Liger kernels are not used (the models run transformers' and megatron-core's own layers)")
LONG_SEQUENCES = "long sequences: use_remove_padding, use_dynamic_bsz, or strategy=megatron with tensor parallelism"
ULYSSES = ((1,), f"Ulysses sequence parallelism is not implemented ({LONG_SEQUENCES})")
CUSTOM_DATASET = dict.fromkeys(("data.custom_cls.path", "data.custom_cls.name"), (
    NULL, "a custom dataset class is not supported; hybridflow.data reads the rows in verl's schema"))


def _under(sections: Iterable[str], table: dict) -> dict:
    """The same keys in each section, section by section."""
    return {f"{section}.{name}": entry for section in sections for name, entry in table.items()}


def _fsdp(section: str, dtype_key: str) -> dict:
    return _under([section], {
        "offload_policy": (OFF, "FSDP2's CPUOffloadPolicy is not used; use param_offload and optimizer_offload"),
        "model_dtype": (("fp32", "float32"), f"the FSDP model holds fp32 master weights; for bf16 compute set "
                                             f"{dtype_key}=bf16"),
        "wrap_policy.min_num_params": ((0,), "FSDP2 shards each decoder layer as a unit"),
    })


_MEGATRON = {
    "sequence_parallel": (ANY, "activation memory only; tensor parallelism runs without it"),
    "use_distributed_optimizer": (ANY, "memory only; the optimizer state is replicated over data-parallel ranks"),
    "virtual_pipeline_model_parallel_size": ((None, 1), "the pipeline runs the 1F1B schedule, not the interleaved one"),
    "context_parallel_size": ((1,), "context parallelism is not implemented"),
    "expert_model_parallel_size": ((1,), "mixture-of-experts models are not supported"),
    "grad_offload": (OFF, "gradients stay on the device"),
    "seed": (ANY, "trainer.seed seeds every rank"),
    "use_dist_checkpointing": (OFF, "checkpoints are per rank in hybridflow's format, exported as HF safetensors"),
    "dist_checkpointing_path": (NULL, "see use_dist_checkpointing"),
}
_MODEL = {
    "use_shm": (ANY, "the checkpoint is read from its path"),
    "enable_activation_offload": (OFF, "activation offload is not implemented; use enable_gradient_checkpointing"),
}
# verl's reward-model worker is an FSDP module; here each worker holds the whole HF sequence
# classifier and scores its share of the batch, reading the actor's token ids
_REWARD_MODEL = {
    **dict.fromkeys(["strategy", *(f"model.fsdp_config.{name}" for name in (
        "param_offload", "fsdp_size", "reshard_after_forward", "forward_prefetch", "wrap_policy.min_num_params"))],
        (ANY, "the reward model is replicated on each worker (no FSDP sharding or offload)")),
    **dict.fromkeys(("model.use_remove_padding", "model.use_fused_kernels"), (ANY, SPEED)),
    **dict.fromkeys(("use_dynamic_bsz", "forward_max_token_len_per_gpu"),
                    (ANY, "speed only: micro_batch_size_per_gpu sets the micro-batches")),
    "model.input_tokenizer": (ANY, "the reward model scores the actor's token ids and must share its vocabulary "
                                   "(checked when it loads)"),
    "model.trust_remote_code": (OFF, NO_REMOTE_CODE),
    "max_length": (NULL, "sequences are scored whole, never truncated"),
    "ulysses_sequence_parallel_size": ULYSSES,
}

# dotted key -> (accepted values or ANY, what it is / why it has no effect)
INERT_KEYS: dict[str, tuple[tuple | None, str]] = {
    "algorithm.use_pf_ppo": (OFF, "PF-PPO's reward-weighted resampling is not implemented"),
    **dict.fromkeys(("data.image_key", "data.video_key"), (ANY, "prompts are text; no image or video column is read")),
    "data.dataloader_num_workers": (ANY, "prompts are tokenized once at start-up; the loader only indexes them"),
    "data.return_raw_chat": (ANY, "rows always carry their raw chat (raw_prompt)"),
    **CUSTOM_DATASET,
    "data.return_full_prompt": (OFF, "the templated prompt text is not carried on the batch"),
    "data.trust_remote_code": (OFF, "remote tokenizer code is never run"),
    "data.filter_overlong_prompts_workers": (ANY, "speed only: the filter reads the files once, before Ray starts"),
    **dict.fromkeys(("data.sampler.class_path", "data.sampler.class_name"),
                    (NULL, "a custom sampler is not supported; data.shuffle and data.seed order the prompts")),
    f"{ARR}.nccl_timeout": (ANY, "trainer.call_timeout_s bounds every worker call"),
    **_under([f"{ARR}.model", "critic.model"], _MODEL),
    f"{ARR}.model.use_liger": NO_LIGER,
    f"{ARR}.actor.use_torch_compile": (ANY, "the engines run eager"),
    **dict.fromkeys((f"{ARR}.actor.entropy_from_logits_with_chunking", f"{ARR}.actor.entropy_checkpointing"),
                    (ANY, MEMORY)),
    **dict.fromkeys((f"{ARR}.actor.optim.total_training_steps", "critic.optim.total_training_steps"),
                    (ANY, "the trainer sets the schedule's length from the run, as verl does")),
    **_fsdp(f"{ARR}.actor.fsdp_config", f"{ARR}.actor.param_dtype"),
    **_fsdp(f"{ARR}.ref.fsdp_config", f"{ARR}.actor.param_dtype (the reference computes as the actor)"),
    **_fsdp("critic.model.fsdp_config", "critic.param_dtype"),
    **_under([f"{ARR}.actor.megatron", f"{ARR}.ref.megatron", "critic.megatron"], _MEGATRON),
    **_under([f"{ARR}.ref", "critic"], {"ulysses_sequence_parallel_size": ULYSSES}),
    **_under([f"{ARR}.rollout"], {
        "calculate_log_probs": (ANY, "the rollout always returns its log-probs (rollout_log_probs)"),
        "layered_summon": (ANY, "the weight sync streams one tensor at a time anyway"),
        "multi_turn.interaction_config_path": (NULL, "simulated-user interactions are not implemented; tools "
                                                     "only (multi_turn.tool_config_path)"),
        "multi_turn.use_inference_chat_template": (OFF, "the trained ids are the sampled ids plus the tool ids, "
                                                        "never a re-rendered chat"),
        "multi_turn.tokenization_sanity_check_mode": (ANY, "earlier turns are never re-tokenized, so there is "
                                                           "nothing to check"),
        "agent.num_workers": (ANY, "the agent loops are coroutines inside each rollout worker, not processes"),
        "agent.agent_loop_config_path": (NULL, "loops are named by agent.default_agent_loop or the data's "
                                               "agent_name column (a registered name or a dotted class path)"),
        **dict.fromkeys(("agent.custom_async_server.path", "agent.custom_async_server.name"),
                        (NULL, "the agent loops use the rollout's own vLLM engine")),
        "trace.backend": (NULL, "rollout tracing is not implemented"),
    }),
    **_under(["reward_model"], _REWARD_MODEL),
    "reward_model.overlong_buffer.log": (ANY, "reward/overlong_* metrics are always logged"),
    "reward_model.sandbox_fusion.url": (NULL, "sandboxed code rewards are not implemented; use custom_reward_function"),
    "async_training.require_batches": ((1,), "the trainer takes whole batches of data.train_batch_size prompts"),
    "async_training.use_trainer_do_validate": (OFF, "validation generates on the rollout pool"),
    **dict.fromkeys([f"async_training.checkpoint_engine.{name}" for name in (
        "enable", "device_buffer_size_M", "overlap_broadcast_and_consume")],
        (ANY, "weights move to the rollout pool as buckets through Ray's object store")),
    "trainer.esi_redundant_time": (ANY, "no elastic server instance expiry to plan for"),
    "trainer.del_local_ckpt_after_load": (OFF, "a checkpoint is never deleted after it is loaded"),
    "trainer.ray_wait_register_center_timeout": (ANY, "workers register through Ray; trainer.call_timeout_s applies"),
    "trainer.use_legacy_worker_impl": (ANY, "there is one worker implementation"),
    **dict.fromkeys(("trainer.profile_steps", "global_profiler.tool", "global_profiler.steps"),
                    (NULL, "profiling is not built in; scripts/bench/ measures each stage")),
}

# the SFT recipe's (verl's fsdp_sft_trainer.yaml)
SFT_INERT_KEYS: dict[str, tuple[tuple | None, str]] = {
    "use_remove_padding": (ANY, "speed only; micro-batches are cut to their longest row"),
    "ulysses_sequence_parallel_size": ULYSSES,
    "data.balance_dp_token": (ANY, SPEED),
    "data.use_shm": (ANY, "files are read from where they are"),
    "data.chat_template": (NULL, "the tokenizer's template is used; change it in the tokenizer's files"),
    **CUSTOM_DATASET,
    "data.multiturn.tools_key": (ANY, "tool schemas are not passed to the chat template"),
    "data.multiturn.enable_thinking_key": (ANY, "per-row thinking switches are not read"),
    "model.use_shm": _MODEL["use_shm"],
    "model.external_lib": (NULL, "not implemented for SFT; use the RL recipe's model.external_lib"),
    "model.trust_remote_code": (OFF, NO_REMOTE_CODE),
    "model.use_liger": NO_LIGER,
    **_fsdp("model.fsdp_config", "model.param_dtype"),
    **dict.fromkeys(("model.fsdp_config.cpu_offload", "model.fsdp_config.offload_params"),
                    (OFF, "use model.fsdp_config.param_offload (and optimizer_offload)")),
    "trainer.default_hdfs_dir": (NULL, "checkpoints stay in trainer.default_local_dir"),
    **dict.fromkeys(("trainer.checkpoint.save_contents", "trainer.checkpoint.load_contents"),
                    (ANY, "SFT checkpoints hold model, optimizer and extra state")),
}


def inert_keys(schema: type) -> dict[str, tuple[tuple | None, str]]:
    """The inert keys of a recipe's config schema (its ``verl_inert_keys``; none for another)."""
    return getattr(schema, "verl_inert_keys", {})


def is_inert(key: str, keys: dict) -> bool:
    return key in keys


def _word(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def pop_inert_keys(tree: dict, schema_keys: Iterable[str], keys: dict) -> list[str]:
    """Remove every inert key from a plain config tree (in place); return one error per key set to
    a value it is not accepted at. A section left empty is removed too when the schema does not
    have it (``data.custom_cls`` exists only for its inert keys)."""
    errors, known = [], set(schema_keys)
    for dotted, (accepted, why) in keys.items():
        *parents, leaf = dotted.split(".")
        nodes = [tree]  # the tree, then each section on the key's path
        for part in parents:
            nodes.append(nodes[-1].get(part) if isinstance(nodes[-1], dict) else None)
        if not isinstance(nodes[-1], dict) or leaf not in nodes[-1]:
            continue
        value = nodes[-1].pop(leaf)
        if accepted is not ANY and value not in accepted:
            errors.append(f"{dotted}={_word(value)}: {why}; set it to {_word(accepted[0])} or remove it")
        for depth in range(len(parents), 0, -1):  # deepest first: emptying one may empty its parent
            if nodes[depth] == {} and ".".join(parents[:depth]) not in known:
                del nodes[depth - 1][parents[depth - 1]]
    return errors


def unsupported_errors(cfg) -> list[str]:
    """verl keys accepted so its scripts run, for the value that means "off" only. Unlike the inert
    keys they are fields: validation reports them beside the config's other errors, each with its fix."""
    arr, hdfs = cfg.actor_rollout_ref, cfg.trainer.default_hdfs_dir
    sp, mode, model = arr.actor.ulysses_sequence_parallel_size, arr.rollout.mode, arr.model
    checks = [
        (sp != 1, f"{ARR}.actor.ulysses_sequence_parallel_size={sp}: Ulysses sequence parallelism is not "
                  f"implemented; set it to 1 ({LONG_SEQUENCES})"),
        (mode != "sync", f"{ARR}.rollout.mode={mode!r}: only sync is implemented (whole batches through the "
                         "engine); set it to sync"),
        (model.use_fused_kernels, f"{ARR}.model.use_fused_kernels=true: these kernels are not used here (the "
                                  "models run transformers' and megatron-core's own layers); set it to false"),
        (model.trust_remote_code, f"{ARR}.model.trust_remote_code=true: {NO_REMOTE_CODE} (the engines support "
                                  "Llama/Qwen2-family models, which transformers ships); set it to false"),
        (hdfs, f"trainer.default_hdfs_dir={hdfs!r}: HDFS upload is not implemented; set it to null and copy "
               "trainer.default_local_dir yourself"),
    ]
    return [message for failed, message in checks if failed]


def _to_per_gpu(node, section: str, name: str, dp: int) -> str | None:
    """verl's deprecated ``name`` counts sequences over all ``dp`` data-parallel ranks; its workers
    divide it by ``dp`` and use the result as ``name_per_gpu``, so this does too, in place. The
    converted key is cleared, so converting again changes nothing. An error when it does not split."""
    total, key = getattr(node, name), f"{section}.{name}"
    if total is None:
        return None
    if dp and (total < dp or total % dp):
        return (f"{key}={total} (verl's deprecated size over all {dp} data-parallel ranks) must be a positive "
                f"multiple of {dp}: set {key}_per_gpu instead (sequences per rank) and remove {key}")
    if dp:
        setattr(node, f"{name}_per_gpu", total // dp)
        logger.warning("%s=%d is deprecated (verl): using %s_per_gpu=%d (%d data-parallel ranks)",
                       key, total, key, total // dp, dp)
    setattr(node, name, None)
    return None


def convert_global_micro_batch_sizes(cfg, actor_dp: int, critic_dp: int, reward_dp: int) -> list[str]:
    """The RL recipe's deprecated global micro-batch sizes (:func:`_to_per_gpu`); assumes the
    parallel sizes were checked."""
    arr = cfg.actor_rollout_ref
    rows = [(arr.actor, f"{ARR}.actor", "ppo_micro_batch_size", actor_dp),
            (arr.rollout, f"{ARR}.rollout", "log_prob_micro_batch_size", actor_dp),
            (arr.ref, f"{ARR}.ref", "log_prob_micro_batch_size", actor_dp),
            (cfg.critic, "critic", "ppo_micro_batch_size", critic_dp),
            (cfg.critic, "critic", "forward_micro_batch_size", critic_dp),
            (cfg.reward_model, "reward_model", "micro_batch_size", reward_dp)]
    return [error for row in rows if (error := _to_per_gpu(*row))]


def convert_sft_micro_batch_size(data, dp: int) -> str | None:
    """The SFT recipe's deprecated ``data.micro_batch_size``: per rank, as verl's SFT trainer does."""
    return _to_per_gpu(data, "data", "micro_batch_size", dp)


def fold_ray_kwargs(root) -> None:
    """verl moved ``ray_init`` under ``ray_kwargs``; accept both, one value per key."""
    new, old = root.ray_kwargs.ray_init, root.ray_init
    for f in dataclasses.fields(new):
        value, current = getattr(new, f.name), getattr(old, f.name)
        if value is None or value == current:
            continue
        if current is not None:
            raise ConfigError(f"ray_kwargs.ray_init.{f.name}={value!r} and ray_init.{f.name}={current!r} set the "
                              "same thing (verl's newer and older key): keep one of them")
        setattr(old, f.name, value)


def resume_path_mode(mode: str, resume_from_path: str | None) -> str:
    """verl's ``resume_mode=resume_path`` means "resume from ``resume_from_path``": that folder."""
    if mode != "resume_path":
        return mode
    if not resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_N "
                          "folder> (or set trainer.resume_mode=<that folder> directly)")
    return resume_from_path


def apply_sft_names(sft) -> None:
    """verl's SFT trainer names the model ``model.partial_pretrain`` and the warmup
    ``optim.warmup_steps_ratio``; set, they win."""
    if sft.model.partial_pretrain:
        sft.model.path = sft.model.partial_pretrain
    if sft.optim.warmup_steps_ratio is not None:
        sft.optim.lr_warmup_steps_ratio = sft.optim.warmup_steps_ratio
