"""Config nodes shared by the actor, the critic and the SFT model: optimizer, LoRA, checkpoint
contents, FSDP and Megatron settings."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import GREATER_THAN_0, NON_NEGATIVE, POSITIVE, UNIT, Range, key

STRATEGIES = ("fsdp", "megatron")  # the engines' names (workers/engines/config.py; tests check they stay equal)
PARAM_DTYPES = ("auto", "fp32", "bf16")  # auto: resolve.resolve_param_dtype
LR_SCHEDULERS = ("constant", "cosine")

BETAS = Range(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "two numbers in [0, 1), e.g. [0.9, 0.999]")


@dataclass
class OptimConfig:  # AdamW and its learning-rate schedule
    lr: float = key(1e-6, "learning rate", GREATER_THAN_0)
    weight_decay: float = key(0.01, "AdamW's decoupled weight decay", NON_NEGATIVE)
    betas: list[float] = key([0.9, 0.999], "AdamW's betas", BETAS)
    eps: float = key(1e-8, "AdamW's epsilon", GREATER_THAN_0)
    lr_warmup_steps: int = key(-1, "linear warmup steps; -1: use lr_warmup_steps_ratio (verl's convention)",
                               Range(lambda v: v >= -1, "-1 (use lr_warmup_steps_ratio) or a step count >= 0"))
    lr_warmup_steps_ratio: float = key(0.0, "warmup as a fraction of the run's optimizer steps",
                                       Range(lambda v: 0 <= v < 1, "in [0, 1)"))
    lr_scheduler: str = key("constant", "constant | cosine", choices=LR_SCHEDULERS)
    lr_scheduler_type: str | None = key(None, "verl's name for lr_scheduler; when set, it wins", choices=LR_SCHEDULERS)
    warmup_style: str | None = key(None, "verl's older name for lr_scheduler; wins over both", choices=LR_SCHEDULERS)
    min_lr_ratio: float = key(0.0, "the cosine schedule's floor, a fraction of lr", UNIT)
    clip_grad: float = key(1.0, "max global grad L2 norm; <= 0 disables clipping")

    @property
    def schedule(self) -> str:
        """The schedule in force: verl's older warmup_style wins, then lr_scheduler_type (as in verl)."""
        return self.warmup_style or self.lr_scheduler_type or self.lr_scheduler


@dataclass
class LoraKeys:  # verl's LoRA keys of a model section (workers/engines/lora.py)
    lora_rank: int = key(0, "> 0 (strategy=fsdp): freeze the model, train rank-r LoRA adapters", NON_NEGATIVE)
    lora_alpha: float = key(16.0, "the adapters' output is scaled by lora_alpha / lora_rank", GREATER_THAN_0)
    target_modules: list[str] = key(["all-linear"], "all-linear (every linear layer of the decoder layers) | "
                                                    "module names, e.g. [q_proj,v_proj]")
    exclude_modules: list[str] = key([], "module names left out of target_modules")


# what verl's checkpoint.save_contents may name; hybridflow always saves the first three
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointContents:
    save_contents: list[str] = key(["model", "optimizer", "extra"], "always these three (exact resume); "
                                   "+ hf_model: an HF checkpoint in <role>/huggingface/ at every save")
    load_contents: list[str] | None = key(None, "null: save_contents")


@dataclass
class FSDPConfig:  # read by workers/engines/fsdp_layout.py and offload.py
    fsdp_size: int | str = key("auto", "ranks sharing one copy: -1 all (FSDP) | 1 replicate (DDP) | k (HSDP) | "
                                       "auto: 1 on CPU if it fits, else -1")
    forward_prefetch: bool = key(True, "sharded, CPU: gather each layer's parameters a layer ahead (overlaps compute)")
    reshard_after_forward: bool = key(True, "sharded: false gathers each layer once per engine call and keeps "
                                            "it (faster, full params per rank)")
    param_offload: bool = key(False, "GPU: parameters rest in host memory between engine calls")
    optimizer_offload: bool = key(False, "GPU: optimizer state rests in host memory between steps")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = key(1, "tensor-parallel size (strategy=fsdp: only 1)", POSITIVE)
    pipeline_model_parallel_size: int = key(1, "pipeline-parallel size (strategy=fsdp: only 1)", POSITIVE)
    param_offload: bool = key(False, "GPU: parameters rest in host memory between engine calls")
    optimizer_offload: bool = key(False, "GPU: optimizer state (with fp32 master weights) rests in host memory")
