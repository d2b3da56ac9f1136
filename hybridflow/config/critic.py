"""``critic``: the value model trained for GAE (verl's key names).

``critic.enable`` None means "whatever the advantage estimator needs" (only gae uses values);
``critic.model.path`` None means "start from the actor's model" with a fresh value head.
``critic.ppo_mini_batch_size`` None means the actor's value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.common import CheckpointContents, FSDPConfig, LoraKeys, MegatronConfig, OptimConfig, path_field


@dataclass
class CriticModelConfig(LoraKeys):  # LoRA: the adapters and the value head train
    path: str | None = path_field(None)
    tokenizer_path: str | None = path_field(None)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    # run each distinct prompt of a micro-batch once and share its KV cache among its samples
    # (exact; FSDP padded layout and Megatron): workers/engines/prefix_sharing.py
    share_prompt_prefix: bool = True
    override_config: dict[str, Any] = field(default_factory=dict)  # as actor_rollout_ref.model's
    external_lib: str | None = None  # as actor_rollout_ref.model's
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  # verl keeps it under critic.model


@dataclass
class CriticConfig:
    enable: bool | None = None
    strategy: str = "fsdp"  # fsdp | megatron
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 4
    forward_micro_batch_size_per_gpu: int | None = None  # values pass; null: ppo_micro_batch_size_per_gpu
    ppo_micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    forward_micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    use_dynamic_bsz: bool = False  # micro-batches by token budget (workers/engines/token_budget.py)
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int | None = None  # values pass; null: ppo_max_token_len_per_gpu
    ppo_epochs: int | None = None  # None: actor.ppo_epochs
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    param_dtype: str = "auto"  # as the actor's: auto | fp32 | bf16
    grad_clip: float | None = None  # verl's key for the max grad norm; None: optim.clip_grad
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)
