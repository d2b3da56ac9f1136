"""``critic``: the value model trained for GAE (verl's key names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.actor_rollout_ref import DEPRECATED_GLOBAL
from hybridflow.config.common import (PARAM_DTYPES, STRATEGIES, CheckpointContents, FSDPConfig, LoraKeys,
                                      MegatronConfig, OptimConfig)
from hybridflow.config.keys import GREATER_THAN_0, OPTIONAL_POSITIVE, POSITIVE, Registry, key


@dataclass
class CriticModelConfig(LoraKeys):  # LoRA: the adapters and the value head train
    path: str | None = key(None, "null: the actor's model with a fresh value head", path=True)
    tokenizer_path: str | None = key(None, "null: the tokenizer saved with the model", path=True)
    enable_gradient_checkpointing: bool = key(False, "recompute activations in backward (less memory)")
    use_remove_padding: bool = key(False, "pack sequences without padding tokens")
    share_prompt_prefix: bool = key(True, "one forward per distinct prompt, its KV cache shared by its n samples")
    group_by_length: bool = key(True, "as actor_rollout_ref.model.group_by_length, for the critic's passes")
    override_config: dict[str, Any] = key({}, "as actor_rollout_ref.model.override_config, for the critic's model")
    external_lib: str | None = key(None, "as actor_rollout_ref.model.external_lib; null: the actor's")
    fsdp_config: FSDPConfig = key(FSDPConfig(), "only with strategy=fsdp (verl keeps it under critic.model)")


@dataclass
class CriticConfig:
    enable: bool | None = key(None, "null: on when algorithm.adv_estimator needs values (gae)")
    strategy: str = key("fsdp", "fsdp | megatron", choices=STRATEGIES)
    model: CriticModelConfig = key(CriticModelConfig(), "the value model")
    optim: OptimConfig = key(OptimConfig(lr=1e-5), "the critic's optimizer")
    ppo_mini_batch_size: int | None = key(None, "null: actor_rollout_ref.actor.ppo_mini_batch_size", OPTIONAL_POSITIVE)
    ppo_micro_batch_size_per_gpu: int = key(4, "sequences per forward/backward on one worker", POSITIVE)
    forward_micro_batch_size_per_gpu: int | None = key(None, "the values pass; null: ppo_micro_batch_size_per_gpu",
                                                       OPTIONAL_POSITIVE)
    ppo_micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    forward_micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    use_dynamic_bsz: bool = key(False, "micro-batches by token budget instead of row count")
    ppo_max_token_len_per_gpu: int = key(32768, "padded tokens per micro-batch with use_dynamic_bsz", POSITIVE)
    forward_max_token_len_per_gpu: int | None = key(None, "the values pass; null: ppo_max_token_len_per_gpu",
                                                    OPTIONAL_POSITIVE)
    ppo_epochs: int | None = key(None, "null: actor_rollout_ref.actor.ppo_epochs", OPTIONAL_POSITIVE)
    cliprange_value: float = key(0.5, "the value loss's clip range", GREATER_THAN_0)
    loss_agg_mode: str = key("token-mean", "as the actor's loss_agg_mode", choices=Registry("LOSS_AGG_MODES"))
    param_dtype: str = key("auto", "as the actor's: auto | fp32 | bf16", choices=PARAM_DTYPES)
    grad_clip: float | None = key(None, "verl's max grad norm key; null: optim.clip_grad")
    megatron: MegatronConfig = key(MegatronConfig(), "only with strategy=megatron")
    checkpoint: CheckpointContents = key(CheckpointContents(), "what a checkpoint holds")
