"""Config nodes shared by the actor and the critic: optimizer and Megatron sizes.

``path_field`` marks a string field as a filesystem path: ``load_config`` expands ``~`` and makes
it absolute (Ray workers need not share the driver's working directory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PATH = {"path": True}


def path_field(default: Any = None) -> Any:
    return field(default=default, metadata=PATH)


@dataclass
class OptimConfig:
    """AdamW + LR schedule. ``lr_warmup_steps`` < 0 means "use ``lr_warmup_steps_ratio`` of the
    run's optimizer steps" (verl's convention); ``min_lr_ratio`` is the cosine floor."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler: str = "constant"  # constant | cosine
    # verl's names for lr_scheduler: lr_scheduler_type (current) and warmup_style (older PPO
    # configs); a set one wins, warmup_style first, as in verl (where it overwrites the other)
    lr_scheduler_type: str | None = None
    warmup_style: str | None = None
    min_lr_ratio: float = 0.0
    clip_grad: float = 1.0  # max global grad L2 norm; <= 0 disables clipping

    @property
    def schedule(self) -> str:
        return getattr(self, self.schedule_key)

    @property
    def schedule_key(self) -> str:
        """The key the schedule was read from, for error messages."""
        return next((k for k in ("warmup_style", "lr_scheduler_type") if getattr(self, k)), "lr_scheduler")


@dataclass
class LoraKeys:
    """verl's LoRA keys of a model section (``strategy=fsdp``): ``lora_rank`` > 0 freezes the model
    and trains rank-r adapters on ``target_modules`` (``all-linear``: every linear layer of the
    decoder layers; or module names such as ``q_proj``), scaled by ``lora_alpha / lora_rank``
    (workers/engines/lora.py). A critic trains its value head in full beside the adapters."""

    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    exclude_modules: list[str] = field(default_factory=list)


# what verl's checkpoint.save_contents may name; hybridflow always saves the first three
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointContents:
    """verl's ``checkpoint`` section of the actor and the critic. A checkpoint here always holds
    the model, the optimizer and the extra state (LR scheduler, RNG), which an exact resume
    needs; ``hf_model`` adds the full weights as an HF checkpoint in ``<role>/huggingface/``
    (safetensors + config + tokenizer, for transformers or vLLM as is) at every save."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] | None = None  # None: save_contents


@dataclass
class FSDPConfig:
    """Only read when ``strategy == "fsdp"``. ``fsdp_size``: how many data-parallel ranks share one
    copy of the parameters. -1: all of them (FSDP); 1: none, each rank holds the whole model and
    gradients are all-reduced (DDP; fastest when the model fits, e.g. small models on CPU);
    k: HSDP (shard within groups of k, replicate across groups); auto (the default): 1 on a CPU
    host whose memory holds every role's replicas easily, else -1 (config/auto_fsdp_size.py).
    ``forward_prefetch`` (sharded layouts, CPU): gather each layer's parameters one layer ahead, in
    forward and in backward, so the gathers overlap compute (see workers/engines/fsdp_layout.py); on
    GPU FSDP2 does this itself.
    ``reshard_after_forward`` (sharded layouts): false keeps each layer's gathered parameters until
    the engine call ends (a training step: every micro-batch's forward and backward), so each layer
    is all-gathered once per call; costs a full copy of the parameters per rank meanwhile.
    ``param_offload`` / ``optimizer_offload`` (verl's keys): on a GPU, the parameters / the
    optimizer state rest in host memory between engine calls (workers/engines/offload.py), the
    usual choice for a frozen reference policy; on CPU there is nothing to move."""

    fsdp_size: int | str = "auto"  # auto | -1 | 1 | k
    forward_prefetch: bool = True
    reshard_after_forward: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class MegatronConfig:
    """Only read when ``strategy == "megatron"``; fsdp requires the sizes to stay 1.
    ``param_offload`` / ``optimizer_offload``: as in :class:`FSDPConfig` (verl keeps them here
    for Megatron; the optimizer state includes the fp32 master weights of a bf16 model)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
