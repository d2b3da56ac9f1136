"""The SFT recipe's config (``--config-name sft``, ``python -m recipes.main_sft``).

Supervised fine-tuning on prompt/response pairs, used to warm-start a policy before RL. The
loss covers response tokens only; ``data.train_batch_size`` counts sequences (there is no
``rollout.n`` here), split over the data-parallel workers and then into micro-batches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridflow.config.common import FSDPConfig, LoraKeys, MegatronConfig, OptimConfig
from hybridflow.config.derived import LR_SCHEDULERS, PARAM_DTYPES, STRATEGIES, canonical_strategy, model_parallel
from hybridflow.config.errors import ConfigError
from hybridflow.config.folders import writable_folder_error
from hybridflow.config.load import to_dataclass
from hybridflow.config.keys import FREQ, GREATER_THAN_0, OPTIONAL_POSITIVE, POSITIVE, key
from hybridflow.config.ranges import tree_range_errors
from hybridflow.config.resolve import resolve_sft
from hybridflow.config.trainer import RUN_DIR, RayInitConfig
from hybridflow.config.rules import (
    DEVICES, TRUNCATION_MODES, fsdp_size_error, hub_id_hint, lora_strategy_errors, unknown_name,
)
from hybridflow.config.verl_compat import SFT_INERT_KEYS, apply_sft_names, resolve_resume_mode
from hybridflow.model_checks import check_divides, read_model_config
from hybridflow.model_files import model_folder_errors


@dataclass
class MultiturnConfig:
    enable: bool = key(False, "rows are conversations; every assistant turn is a target (needs a chat template)")
    messages_key: str = key("messages", "the column of [{role, content}, ...] lists")


@dataclass
class SFTDataConfig:
    train_files: list[str] = key(["data/arithmetic/sft_train.parquet"], "parquet or jsonl files", path=True)
    val_files: list[str] = key(["data/arithmetic/sft_val.parquet"], "validation files", path=True)
    prompt_key: str = key("prompt", "the prompt column: a string or a list of chat messages")
    response_key: str = key("response", "the response column: a string")
    prompt_dict_keys: list[str] | None = key(None, "the prompt column holds a dict: keys to the text, e.g. "
                                                   "[question] (verl's)")
    response_dict_keys: list[str] | None = key(None, "as prompt_dict_keys, for the response column")
    max_length: int = key(64, "prompt + response tokens", POSITIVE)
    truncation: str = key("error", "error | left | right")
    apply_chat_template: bool | None = key(None, "null: chat-message prompts when the tokenizer has a template; "
                                                 "true: plain-string prompts too")
    multiturn: MultiturnConfig = key(MultiturnConfig(), "verl's data.multiturn")
    train_batch_size: int = key(32, "sequences per optimizer step", POSITIVE)
    micro_batch_size_per_gpu: int = key(8, "sequences per forward/backward on one worker", POSITIVE)
    micro_batch_size: int | None = key(None, "verl's deprecated size over all data-parallel workers (converted)")
    shuffle: bool = key(True, "shuffle the rows each epoch")
    seed: int = key(0, "the shuffle's seed")


@dataclass
class SFTModelConfig(LoraKeys):
    path: str = key("data/models/tiny-qwen2-init", "the HF checkpoint folder to fine-tune", path=True)
    partial_pretrain: str | None = key(None, "verl's SFT name for model.path; when set, it wins", path=True)
    tokenizer_path: str | None = key(None, "null: the tokenizer saved with the model", path=True)
    enable_gradient_checkpointing: bool = key(False, "recompute activations in backward (less memory)")
    strategy: str = key("fsdp", "fsdp | megatron")
    param_dtype: str = key("auto", "auto | fp32 | bf16: as the RL recipes' actor.param_dtype")
    fsdp_config: FSDPConfig = key(FSDPConfig(), "only with strategy=fsdp")
    megatron: MegatronConfig = key(MegatronConfig(), "only with strategy=megatron")


@dataclass
class SFTOptimConfig(OptimConfig):
    warmup_steps_ratio: float | None = key(None, "verl's SFT name for lr_warmup_steps_ratio; when set, it wins")


@dataclass
class SFTTrainerConfig:
    device: str = key("auto", "auto | cpu | cuda")
    nnodes: int = key(1, "nodes", POSITIVE)
    n_gpus_per_node: int = key(1, "GPUs per node; on CPU: worker slots per node", POSITIVE)
    total_epochs: int = key(3, "passes over the training rows", POSITIVE)
    total_training_steps: int | None = key(None, "null: epochs x batches per epoch", OPTIONAL_POSITIVE)
    save_freq: int = key(-1, "steps between checkpoints (plus one at the end); -1: none", FREQ)
    test_freq: int = key(-1, "steps between validations; -1: after every epoch", FREQ)
    default_local_dir: str = key("checkpoints/hybridflow-sft/sft", "the run's folder: checkpoints, logs, metrics",
                                 path=True, composed=RUN_DIR)
    hf_output_dir: str | None = key(None, "the final HF checkpoint; null: <default_local_dir>/hf", path=True)
    resume_mode: str = key("disable", "auto (the newest checkpoint under default_local_dir) | disable | a folder | "
                                      "resume_path")
    resume_from_path: str | None = key(None, "with resume_mode=resume_path (verl's form): a global_step_N or run "
                                             "folder", path=True)
    max_ckpt_to_keep: int | None = key(None, "null: keep all", OPTIONAL_POSITIVE)
    logger: list[str] = key(["console", "jsonl"], "console | jsonl | tensorboard | mlflow | wandb")
    project_name: str = key("hybridflow-sft", "the tracking project")
    experiment_name: str = key("sft", "the tracking run's name")
    call_timeout_s: float = key(600.0, "every worker call and collective", GREATER_THAN_0)
    init_timeout_s: float = key(1800.0, "the workers' start-up (init_model)", GREATER_THAN_0)
    cpus_per_worker: float = key(1.0, "Ray CPU resources per worker process", GREATER_THAN_0)
    seed: int = key(0, "seeds every rank")


@dataclass
class SFTConfig:
    verl_inert_keys: ClassVar[dict] = SFT_INERT_KEYS
    data: SFTDataConfig = key(SFTDataConfig(), "prompt/response rows and the batch shape")
    model: SFTModelConfig = key(SFTModelConfig(), "the model fine-tuned")
    optim: SFTOptimConfig = key(SFTOptimConfig(lr=1e-4), "the optimizer")
    trainer: SFTTrainerConfig = key(SFTTrainerConfig(), "the loop, outputs and resources")
    ray_init: RayInitConfig = key(RayInitConfig(), "Ray's start")


def load_sft_config(cfg: Any, *, base_dir: str | None = None) -> SFTConfig:
    """Like ``load_config`` for the SFT tree: unknown keys and wrong types raise ConfigError."""
    sft = to_dataclass(SFTConfig, cfg, base_dir=base_dir)
    sft.model.strategy = canonical_strategy(sft.model.strategy)
    resolve_sft(sft)
    apply_sft_names(sft)
    t = sft.trainer
    t.resume_mode = resolve_resume_mode(t.resume_mode, t.resume_from_path, base_dir)
    if t.hf_output_dir is None:  # beside the run's checkpoints, as the RL recipe's hf/
        t.hf_output_dir = os.path.join(t.default_local_dir, "hf")
    return sft


def validate_sft(cfg: SFTConfig, *, available_slots: int | None = None,
                 model_config: dict | None = None, check_paths: bool = True) -> None:
    """Raise ConfigError (one line, every problem) if the SFT run cannot start."""
    from hybridflow.tracking.tracker import BACKENDS, backend_import_errors

    d, m, t = cfg.data, cfg.model, cfg.trainer
    errors = tree_range_errors(cfg)
    names = [("model.strategy", m.strategy, STRATEGIES), ("model.param_dtype", m.param_dtype, PARAM_DTYPES),
             (f"optim.{cfg.optim.schedule_key}", cfg.optim.schedule, LR_SCHEDULERS),
             ("data.truncation", d.truncation, TRUNCATION_MODES), ("trainer.device", t.device, DEVICES)]
    errors += [unknown_name(k, val, allowed) for k, val, allowed in names if val not in allowed]
    errors += [unknown_name("trainer.logger", n, BACKENDS) for n in t.logger if n not in BACKENDS]
    errors += backend_import_errors(t.logger)
    errors += lora_strategy_errors("model", m.lora_rank, "model.strategy", m.strategy)
    if errors:
        raise ConfigError("; ".join(errors))

    world = t.nnodes * t.n_gpus_per_node
    tp, pp = model_parallel(m.strategy, m.megatron)
    if m.strategy != "megatron" and (m.megatron.tensor_model_parallel_size, m.megatron.pipeline_model_parallel_size) != (1, 1):
        errors.append("model.megatron.* sizes only apply to model.strategy=megatron: set "
                      "model.strategy=megatron or both sizes to 1")
    elif world % (tp * pp):
        errors.append(f"model.megatron: {world} workers cannot be split into tp*pp={tp * pp} groups "
                      "evenly: change the sizes or trainer.n_gpus_per_node")
    else:
        errors.append(fsdp_size_error("model", m.strategy, m.fsdp_config.fsdp_size, world))
        dp = world // (tp * pp)
        if d.micro_batch_size is not None:  # verl's deprecated global size: per rank, as verl's trainer does
            if d.micro_batch_size % dp:
                errors.append(f"data.micro_batch_size={d.micro_batch_size} (verl's deprecated size over all {dp} "
                              "data-parallel workers) must be a multiple of that: set data.micro_batch_size_per_gpu "
                              "instead and remove it")
            else:
                d.micro_batch_size_per_gpu, d.micro_batch_size = d.micro_batch_size // dp, None
        if d.train_batch_size % (d.micro_batch_size_per_gpu * dp):
            errors.append(f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                          f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu} x {dp} "
                          "data-parallel workers")
    errors = [e for e in errors if e]
    if check_paths:
        # a corrupt config.json is named here, not read below
        files = (model_folder_errors("model.path", m.path)
                 + model_folder_errors("model.tokenizer_path", m.tokenizer_path))
        errors += _sft_path_errors(cfg) + files
        if model_config is None and not files:
            model_config = read_model_config(m.path)
    if model_config is not None:
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
            check_divides(errors, "model.megatron.tensor_model_parallel_size", tp, name, model_config.get(name))
        check_divides(errors, "model.megatron.pipeline_model_parallel_size", pp, "num_hidden_layers",
                   model_config.get("num_hidden_layers"))
        max_pos = model_config.get("max_position_embeddings")
        if max_pos is not None and d.max_length > max_pos:
            errors.append(f"data.max_length={d.max_length} exceeds the model's "
                          f"max_position_embeddings={max_pos}: lower it")
    if available_slots is not None and world > available_slots:
        errors.append(f"the run needs {world} workers (trainer.nnodes*trainer.n_gpus_per_node) but "
                      f"only {available_slots} slots are available: lower trainer.n_gpus_per_node")
    if t.device == "cuda":
        from hybridflow.device import device_count

        if device_count() == 0:
            errors.append("trainer.device=cuda but no GPU is visible: use trainer.device=auto or cpu")
    if errors:
        raise ConfigError("; ".join(errors))


def _sft_path_errors(cfg: SFTConfig) -> list[str]:
    errors = []
    if not cfg.data.train_files:
        errors.append("data.train_files is empty: give at least one parquet/jsonl file")
    for key, paths in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        errors += [f"{key}[{i}]: {p} is not an existing file: fix the path"
                   for i, p in enumerate(paths) if not os.path.isfile(p)]
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        errors.append(f"model.path: {cfg.model.path} is not an HF checkpoint directory (no "
                      f"config.json): fix the path{hub_id_hint(cfg.model.path)}")
    problem = writable_folder_error(cfg.trainer.default_local_dir, keep=False)  # a bad one fails before Ray
    if problem:
        errors.append(f"trainer.default_local_dir: cannot write to {cfg.trainer.default_local_dir} ({problem}): "
                      "use a writable folder")
    return errors
