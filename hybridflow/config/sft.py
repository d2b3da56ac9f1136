"""The SFT recipe's config (``--config-name sft``, ``python -m recipes.main_sft``).

Supervised fine-tuning on prompt/response pairs, used to warm-start a policy before RL. The
loss covers response tokens only; ``data.train_batch_size`` counts sequences (there is no
``rollout.n`` here), split over the data-parallel workers and then into micro-batches.
A key both recipes read alike takes the RL recipe's declaration (:func:`_rl`).
"""
from __future__ import annotations

import functools
import os
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar

from hybridflow.config.actor_rollout_ref import ActorConfig, ModelConfig
from hybridflow.config.common import FSDPConfig, LoraKeys, MegatronConfig, OptimConfig
from hybridflow.config.data import DataConfig
from hybridflow.config.derived import canonical_strategy, model_parallel
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import OPTIONAL_POSITIVE, POSITIVE, key
from hybridflow.config.load import resolve_resume_mode, to_dataclass
from hybridflow.config.ranges import name_errors, tree_range_errors
from hybridflow.config.resolve import resolve_sft
from hybridflow.config.rules import fsdp_size_error, lora_strategy_errors
from hybridflow.config.trainer import RayInitConfig, TrainerConfig
from hybridflow.config.validate import logger_errors, sizes_error, unused_megatron_error
from hybridflow.host_checks import data_file_errors, device_errors, hub_id_hint, output_folder_errors
from hybridflow.model_checks import megatron_shape_errors, read_model_config
from hybridflow.model_files import model_folder_errors
from hybridflow.verl_compat import SFT_INERT_KEYS, apply_sft_names, convert_sft_micro_batch_size


def _rl(cls: type, name: str, default: Any = MISSING, doc: str | None = None) -> Any:
    """The RL recipe's declaration of ``cls.name`` (doc, range, names, path); the SFT default or doc where given."""
    f = cls.__dataclass_fields__[name]
    default = (f.default if f.default_factory is MISSING else f.default_factory()) if default is MISSING else default
    return key(default, **{**f.metadata, "doc": doc or f.metadata["doc"]})


_data, _model, _actor, _trainer = (functools.partial(_rl, cls)
                                   for cls in (DataConfig, ModelConfig, ActorConfig, TrainerConfig))


@dataclass
class MultiturnConfig:
    enable: bool = key(False, "rows are conversations; every assistant turn is a target (needs a chat template)")
    messages_key: str = key("messages", "the column of [{role, content}, ...] lists")


@dataclass
class SFTDataConfig:
    train_files: list[str] = key(["data/arithmetic/sft_train.parquet"], "parquet or jsonl files", path=True)
    val_files: list[str] = _data("val_files", ["data/arithmetic/sft_val.parquet"])
    prompt_key: str = key("prompt", "the prompt column: a string or a list of chat messages")
    response_key: str = key("response", "the response column: a string")
    prompt_dict_keys: list[str] | None = key(None, "the prompt column holds a dict: keys to the text, e.g. "
                                                   "[question] (verl's)")
    response_dict_keys: list[str] | None = key(None, "as prompt_dict_keys, for the response column")
    max_length: int = key(64, "prompt + response tokens", POSITIVE)
    truncation: str = _data("truncation", doc="error | left | right")
    apply_chat_template: bool | None = _data("apply_chat_template")
    multiturn: MultiturnConfig = key(MultiturnConfig(), "verl's data.multiturn")
    train_batch_size: int = _data("train_batch_size", 32, "sequences per optimizer step")
    micro_batch_size_per_gpu: int = key(8, "sequences per forward/backward on one worker", POSITIVE)
    micro_batch_size: int | None = key(None, "verl's deprecated size over all data-parallel workers (converted)")
    shuffle: bool = _data("shuffle", doc="shuffle the rows each epoch")
    seed: int = _data("seed")


@dataclass
class SFTModelConfig(LoraKeys):
    path: str = key("data/models/tiny-qwen2-init", "the HF checkpoint folder to fine-tune", path=True)
    partial_pretrain: str | None = key(None, "verl's SFT name for model.path; when set, it wins", path=True)
    tokenizer_path: str | None = _model("tokenizer_path")
    enable_gradient_checkpointing: bool = _model("enable_gradient_checkpointing")
    strategy: str = _actor("strategy")
    param_dtype: str = _actor("param_dtype", doc="auto | fp32 | bf16: as the RL recipes' actor.param_dtype")
    fsdp_config: FSDPConfig = _actor("fsdp_config")
    megatron: MegatronConfig = _actor("megatron")


@dataclass
class SFTOptimConfig(OptimConfig):
    warmup_steps_ratio: float | None = key(None, "verl's SFT name for lr_warmup_steps_ratio; when set, it wins")


@dataclass
class SFTTrainerConfig:
    device: str = _trainer("device")
    nnodes: int = _trainer("nnodes")
    n_gpus_per_node: int = _trainer("n_gpus_per_node", doc="GPUs per node; on CPU: worker slots per node")
    total_epochs: int = _trainer("total_epochs", 3, "passes over the training rows")
    total_training_steps: int | None = _trainer("total_training_steps")
    save_freq: int = _trainer("save_freq", doc="steps between checkpoints (plus one at the end); -1: none")
    test_freq: int = _trainer("test_freq", doc="steps between validations; -1: after every epoch")
    default_local_dir: str = _trainer("default_local_dir", "checkpoints/hybridflow-sft/sft")
    hf_output_dir: str | None = key(None, "the final HF checkpoint; null: <default_local_dir>/hf", path=True)
    resume_mode: str = _trainer("resume_mode", "disable", "auto (the newest checkpoint under default_local_dir) | "
                                                          "disable | a folder | resume_path")
    resume_from_path: str | None = _trainer("resume_from_path", doc="with resume_mode=resume_path (verl's form): "
                                                                    "a global_step_N or run folder")
    max_ckpt_to_keep: int | None = key(None, "null: keep all", OPTIONAL_POSITIVE)
    logger: list[str] = _trainer("logger", doc="console | jsonl | tensorboard | mlflow | wandb")
    project_name: str = _trainer("project_name", "hybridflow-sft")
    experiment_name: str = _trainer("experiment_name", "sft")
    call_timeout_s: float = _trainer("call_timeout_s", doc="every worker call and collective")
    init_timeout_s: float = _trainer("init_timeout_s", doc="the workers' start-up (init_model)")
    cpus_per_worker: float = _trainer("cpus_per_worker")
    seed: int = _trainer("seed")


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
    """Raise ConfigError (one line, every problem) if the SFT run cannot start; as ``validate``."""
    d, m, t = cfg.data, cfg.model, cfg.trainer
    errors = (tree_range_errors(cfg) + name_errors(cfg) + logger_errors(t.logger)
              + lora_strategy_errors("model", m.lora_rank, "model.strategy", m.strategy))
    if errors:  # the checks below divide by these values
        raise ConfigError("; ".join(errors))
    world = t.nnodes * t.n_gpus_per_node
    tp, pp = model_parallel(m.strategy, m.megatron)
    layout = unused_megatron_error("model", m) or sizes_error("model.megatron (tensor x pipeline parallel)", world,
                                                             "tp*pp", tp * pp)
    errors = [layout]
    if not layout:  # the batch rule divides by the data-parallel size
        dp = world // (tp * pp)
        errors += [fsdp_size_error("model", m.strategy, m.fsdp_config.fsdp_size, world),
                   convert_sft_micro_batch_size(d, dp)]
        if d.train_batch_size % (d.micro_batch_size_per_gpu * dp):
            errors.append(f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                          f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu} x {dp} "
                          "data-parallel workers")
    if check_paths:
        # a corrupt config.json is named here, not read below
        files = model_folder_errors("model.path", m.path)
        files += model_folder_errors("model.tokenizer_path", m.tokenizer_path)
        errors += data_file_errors(d)
        if not os.path.isfile(os.path.join(m.path, "config.json")):
            errors.append(f"model.path: {m.path} is not an HF checkpoint directory (no config.json): fix the "
                          f"path{hub_id_hint(m.path)}")
        errors += output_folder_errors(t, ["default_local_dir"]) + files
        if model_config is None and not files:
            model_config = read_model_config(m.path)
    if model_config is not None:
        errors += megatron_shape_errors("model", tp, pp, model_config)
        max_pos = model_config.get("max_position_embeddings")
        if max_pos is not None and d.max_length > max_pos:
            errors.append(f"data.max_length={d.max_length} exceeds the model's "
                          f"max_position_embeddings={max_pos}: lower it")
    errors += device_errors(t, cfg.ray_init.address, available_slots)
    errors = [e for e in errors if e]
    if errors:
        raise ConfigError("; ".join(errors))
