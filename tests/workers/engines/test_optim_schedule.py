"""Learning-rate schedule (warm-up, then constant or cosine) and EngineConfig validation."""
from __future__ import annotations

import math

import pytest
import torch

from workers.engines.config import EngineConfig
from workers.engines.optim import build_optimizer, build_scheduler, load_scheduler_state, lr_multiplier


def _lrs(config: EngineConfig, steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], config)
    sched = build_scheduler(opt, config)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_warmup_then_cosine_by_hand():
    config = EngineConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine", total_steps=12, min_lr_ratio=0.1).validate()
    lrs = _lrs(config, 14)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warm-up, step 0 already trains
    # cosine over the 8 post-warm-up steps: 0.1 + 0.9 * (1 + cos(pi * k / 8)) / 2
    for k in range(8):
        assert lrs[4 + k] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * k / 8)))
    assert lrs[12:] == pytest.approx([0.1, 0.1])  # held at the floor after total_steps


def test_warmup_then_constant_and_no_warmup():
    assert _lrs(EngineConfig(lr=2.0, warmup_steps=2).validate(), 4) == pytest.approx([1.0, 2.0, 2.0, 2.0])
    assert lr_multiplier(0, warmup_steps=0, schedule="cosine", total_steps=10) == pytest.approx(1.0)
    assert lr_multiplier(5, warmup_steps=0, schedule="cosine", total_steps=10) == pytest.approx(0.5)


def test_scheduler_state_resumes_mid_schedule():
    config = EngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6).validate()
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], config)
    sched = build_scheduler(opt, config)
    for _ in range(3):
        opt.step()
        sched.step()
    opt2 = build_optimizer([param], config)
    sched2 = build_scheduler(opt2, config)
    load_scheduler_state(sched2, sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 1 / 4)))


def test_resume_follows_this_runs_schedule_and_lr():
    """A 2-step cosine run resumed into a 4-step one: the next step's lr is the 4-step schedule's
    at step 2 (0.5), not the saved schedule's (0), and a changed base lr applies from there."""
    param = torch.nn.Parameter(torch.zeros(1))
    short = EngineConfig(lr=1.0, lr_schedule="cosine", total_steps=2).validate()
    opt = build_optimizer([param], short)
    sched = build_scheduler(opt, short)
    for _ in range(2):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    for lr, expected in ((1.0, 0.5), (0.1, 0.05)):
        longer = EngineConfig(lr=lr, lr_schedule="cosine", total_steps=4).validate()
        opt2 = build_optimizer([param], longer)
        sched2 = build_scheduler(opt2, longer)
        opt2.load_state_dict(saved_opt)  # brings back the saved param-group lr (0.0)
        load_scheduler_state(sched2, saved_sched)
        assert opt2.param_groups[0]["lr"] == pytest.approx(expected)
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


@pytest.mark.parametrize("overrides, field", [
    (dict(strategy="deepspeed"), "strategy"),
    (dict(tp=2), "tp/pp"),
    (dict(param_dtype="fp16"), "param_dtype"),
    (dict(lr=0.0), "lr"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(lr_schedule="linear"), "lr_schedule"),
    (dict(lr_schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
    (dict(micro_batch_size_per_gpu=0), "micro_batch_size_per_gpu"),
    (dict(warmup_steps=-1), "warmup_steps"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"engine config: {field}="):
        EngineConfig(**overrides).validate()


def test_megatron_strategy_accepts_model_parallel_sizes():
    assert EngineConfig(strategy="megatron", tp=2, pp=2).validate().tp == 2
