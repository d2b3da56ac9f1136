"""EngineConfig: the settings every training engine (FSDP2, Megatron) reads.

One dataclass for both backends so a recipe switches ``strategy`` without renaming keys. Fields
follow docs/contracts.md ("Training engine"); ``min_lr_ratio`` and ``adam_eps`` are additions
with defaults that keep the textbook behaviour (cosine decays to 0, AdamW's usual eps).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("fsdp", "megatron")
PARAM_DTYPES = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class EngineConfig:
    strategy: str = "fsdp"
    tp: int = 1
    pp: int = 1
    # "bf16": compute in bf16, keep fp32 master weights, fp32 optimizer state and fp32 gradient
    # reduction. "fp32": everything in fp32 (the CPU default: CPU bf16 matmuls are slow).
    param_dtype: str = "fp32"
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int = 0  # optimizer steps in the whole run; only the cosine schedule needs it
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global L2 norm of the gradient; <= 0 disables clipping
    micro_batch_size_per_gpu: int = 4
    gradient_checkpointing: bool = False
    # FSDP: zero the checkpoint's dropout rates. RL (the default) trains the policy vLLM samples
    # from, which has none; the SFT recipe keeps the checkpoint's, as verl's and TRL's SFT do.
    disable_dropout: bool = True
    use_remove_padding: bool = False
    # Run each distinct prompt of a micro-batch once and share its keys/values among the rows that
    # repeat it (GRPO's n samples). FSDP: padded layout only; Megatron: every layout.
    # See workers/engines/prefix_sharing.py
    share_prompt_prefix: bool = True
    # Reorder a rank's rows by length (a prompt's samples kept together) before cutting them into
    # micro-batches, so each micro-batch is cut to a similar length. See workers/engines/length_order.py
    group_by_length: bool = True  # model.group_by_length: length-ordered micro-batches where they pad less
    # FSDP only: ranks one parameter is sharded over. -1: all data-parallel ranks (FSDP);
    # 1: none, every rank holds the full model (DDP); k: HSDP, shard within k, replicate across.
    fsdp_size: int = -1
    # FSDP sharded layouts on CPU: all-gather each layer's parameters one layer ahead (async gloo),
    # forward and backward. See workers/engines/fsdp_layout.py prefetch_async
    forward_prefetch: bool = True
    # FSDP sharded layouts: False keeps each layer's gathered parameters from its first use in an
    # engine call (a training step's forwards and backwards, a log-prob pass) to the call's end:
    # one all-gather per layer per call instead of one per forward and backward of every
    # micro-batch, for a full copy of the parameters on every rank meanwhile. See fsdp_layout.py
    reshard_after_forward: bool = True
    # Rows per forward-only pass (log-probs, values); None: micro_batch_size_per_gpu. verl's
    # rollout.log_prob_micro_batch_size_per_gpu (the actor's old log-probs) and
    # critic.forward_micro_batch_size_per_gpu: no backward, so it may be larger than training's.
    infer_micro_batch_size_per_gpu: int | None = None
    # verl's use_dynamic_bsz: micro-batches of at most this many padded tokens instead of a row
    # count (workers/engines/token_budget.py); None: micro_batch_size_per_gpu rows. Training and
    # forward-only passes each have their own.
    max_token_len_per_gpu: int | None = None
    infer_max_token_len_per_gpu: int | None = None
    # verl's param_offload / optimizer_offload: on a GPU, keep the parameters / the optimizer
    # state in host memory between engine calls (workers/engines/offload.py); nothing moves on CPU
    param_offload: bool = False
    optimizer_offload: bool = False
    # Megatron, PP >= 2: lay the pipeline out backwards, stage s on pipeline rank P-1-s. A critic
    # reversed against the actor lets PPO's two updates run as one fused schedule whose micro-
    # batches flow in opposite directions and fill each other's bubbles (RLHFuse, arXiv
    # 2409.13221; workers/engines/megatron_fused.py). Numbers are those of the plain layout.
    reverse_pipeline: bool = False
    # LoRA (FSDP only): rank 0 trains every weight; > 0 freezes the model and trains rank-r
    # adapters on target_modules ("all-linear" or module names), scaled by alpha / rank
    # (workers/engines/lora.py). verl's model.lora_rank / lora_alpha / target_modules / exclude_modules
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: str | list[str] = "all-linear"
    exclude_modules: list[str] | None = None
    # verl's model.override_config: HF config attributes replaced before the model is built
    # (hybridflow/model_overrides.py); the engine's hf_config, save_hf and checkpoints carry them
    override_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def infer_micro(self) -> int:
        return self.infer_micro_batch_size_per_gpu or self.micro_batch_size_per_gpu

    def validate(self) -> "EngineConfig":
        """Raise ValueError naming the offending field and how to fix it; return self if valid."""
        def bad(field: str, value, fix: str):
            raise ValueError(f"engine config: {field}={value!r} is invalid; {fix}")

        if self.strategy not in STRATEGIES:
            bad("strategy", self.strategy, f"use one of {STRATEGIES}")
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(name, value, "use a positive integer")
        if self.strategy == "fsdp" and (self.tp != 1 or self.pp != 1):
            bad("tp/pp", (self.tp, self.pp), "the fsdp strategy shards data-parallel only: set tp=1 "
                "and pp=1, or use strategy='megatron'")
        if self.param_dtype not in PARAM_DTYPES:
            bad("param_dtype", self.param_dtype, f"use one of {PARAM_DTYPES}")
        if not self.lr > 0:
            bad("lr", self.lr, "use a positive learning rate")
        if self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, "use a value >= 0")
        if len(tuple(self.betas)) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad("betas", self.betas, "use two numbers in [0, 1), e.g. (0.9, 0.999)")
        if not self.adam_eps > 0:
            bad("adam_eps", self.adam_eps, "use a small positive number such as 1e-8")
        if self.warmup_steps < 0:
            bad("warmup_steps", self.warmup_steps, "use 0 (no warm-up) or a positive step count")
        if self.lr_schedule not in LR_SCHEDULES:
            bad("lr_schedule", self.lr_schedule, f"use one of {LR_SCHEDULES}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            bad("total_steps", self.total_steps, f"the cosine schedule needs total_steps > warmup_steps "
                f"({self.warmup_steps}); set it to the number of optimizer steps in the run")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", self.min_lr_ratio, "use a fraction in [0, 1]")
        if not isinstance(self.fsdp_size, int) or not (self.fsdp_size == -1 or self.fsdp_size >= 1):
            bad("fsdp_size", self.fsdp_size, "use -1 (shard over all data-parallel ranks), 1 (replicate) or "
                "a positive divisor of the data-parallel size")
        if self.fsdp_size != -1 and self.strategy != "fsdp":
            bad("fsdp_size", self.fsdp_size, "it only applies to strategy='fsdp'; leave it at -1")
        if not isinstance(self.micro_batch_size_per_gpu, int) or self.micro_batch_size_per_gpu < 1:
            bad("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, "use a positive integer")
        infer = self.infer_micro_batch_size_per_gpu
        if infer is not None and (not isinstance(infer, int) or infer < 1):
            bad("infer_micro_batch_size_per_gpu", infer, "use a positive integer, or None for micro_batch_size_per_gpu")
        for name in ("max_token_len_per_gpu", "infer_max_token_len_per_gpu"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(name, value, "use a positive token count, or None for fixed-size micro-batches")
        if self.reverse_pipeline and self.strategy != "megatron":
            bad("reverse_pipeline", self.reverse_pipeline, "only strategy='megatron' has pipeline stages to reverse")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            bad("lora_rank", self.lora_rank, "use 0 (no LoRA) or a positive adapter rank")
        if self.lora_rank and self.strategy != "fsdp":
            bad("lora_rank", self.lora_rank, "LoRA adapters are implemented for strategy='fsdp'; set lora_rank=0 "
                "or use the fsdp strategy")
        if self.lora_rank and not self.lora_alpha > 0:
            bad("lora_alpha", self.lora_alpha, "use a positive scale (the adapter's output is scaled by alpha/rank)")
        return self
