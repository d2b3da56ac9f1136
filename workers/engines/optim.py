"""AdamW and the learning-rate schedule shared by the training engines.

Schedule: linear warm-up from ``lr / warmup_steps`` (step 0 trains with a non-zero lr, unlike
schedules that start at exactly 0) up to ``lr`` at step ``warmup_steps``, then either constant or a
half-cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total_steps`` (held there afterwards).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from workers.engines.config import EngineConfig


def lr_multiplier(step: int, *, warmup_steps: int, schedule: str, total_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> float:
    """Factor applied to the base lr for the optimizer step with 0-based index ``step``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule={schedule!r} is unknown; use 'constant' or 'cosine'")


def build_optimizer(params: Iterable[torch.nn.Parameter], config: EngineConfig) -> torch.optim.AdamW:
    # fused=True: one kernel per tensor list, on CPU as on GPU, and on DTensor shards too. On this
    # CPU it is 4-5x faster than the multi-tensor (foreach) path, whose separate sqrt pass alone
    # costs more than the fused step: 0.037 vs 0.15-0.20 s for 25M parameters on one thread.
    return torch.optim.AdamW(list(params), lr=config.lr, betas=tuple(config.betas), eps=config.adam_eps,
                             weight_decay=config.weight_decay, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, config: EngineConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_multiplier`; its state_dict is just the step counter (resumable)."""
    def factor(step: int) -> float:
        return lr_multiplier(step, warmup_steps=config.warmup_steps, schedule=config.lr_schedule,
                             total_steps=config.total_steps, min_lr_ratio=config.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Restore a scheduler's step counter and set the lr the next optimizer step uses from *this*
    run's schedule at that step.

    ``LRScheduler.load_state_dict`` also restores the saved base lrs and last lr, and the optimizer
    state brings back the saved param-group lr. Both belong to the run that saved: a resume that
    changes ``total_training_steps`` (a cosine schedule's length) or ``optim.lr`` would train its
    first step at the old schedule's lr (a 2-step cosine run resumed into 4 steps used lr 0 for
    step 3). So only the step counter is kept; the rest comes from the config.
    """
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = base_lrs
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def move_optimizer_state(optimizer: torch.optim.Optimizer | None, target: torch.device) -> None:
    """Move AdamW's moment tensors to ``target`` (engine offload/onload); the step count stays put."""
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(target, non_blocking=True)
