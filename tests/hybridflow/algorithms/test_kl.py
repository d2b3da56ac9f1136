import math

import pytest
import torch

from hybridflow.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    approx_kl,
    clipfrac,
    explained_variance,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)

LOGP = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-0.5, -0.5]])  # d = logp - ref = [0.5, -0.5]


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", [0.5, -0.5]),
        ("kl", [0.5, -0.5]),
        ("abs", [0.5, 0.5]),
        ("k2", [0.125, 0.125]),
        ("mse", [0.125, 0.125]),
        ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5]),
        ("low_var_kl", [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5]),
    ],
)
def test_kl_estimators(kl_type, expected):
    assert kl_penalty(LOGP, REF, kl_type)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_is_clamped_when_the_policy_collapses():
    value = kl_penalty(torch.tensor([[-40.0]]), torch.tensor([[0.0]]), "low_var_kl")
    assert value.item() == 10.0


def test_kl_loss_is_differentiable_and_masked():
    logp = torch.tensor([[0.0, -1.0, 3.0]], requires_grad=True)
    loss = kl_loss(logp, torch.tensor([[-0.5, -0.5, 0.0]]), torch.tensor([[1, 1, 0]]), kl_type="k2")
    assert loss.item() == pytest.approx(0.125)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.25, -0.25, 0.0])  # d(0.5 d^2)/d logp / 2 tokens


def test_unknown_kl_type_lists_names():
    with pytest.raises(ValueError) as err:
        get_kl_estimator("full")
    assert all(name in str(err.value) for name in KL_ESTIMATORS)


def test_adaptive_controller_follows_ziegler_update_and_checkpoints():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=100)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctrl.update(current_kl=3.0, n_steps=100)  # error -0.5 clipped to -0.2
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 0.998)
    ctrl.update(current_kl=6.6, n_steps=100)  # error +0.1 (inside the clip)
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 0.998 * 1.001)
    resumed = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=1.0)
    resumed.load_state_dict(ctrl.state_dict())
    ctrl.update(4.0, 10)
    resumed.update(4.0, 10)
    assert resumed.value == ctrl.value and resumed.state_dict() == ctrl.state_dict()


def test_fixed_controller_and_factory_errors():
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(100.0, 8)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.05
    assert isinstance(make_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError, match="needs kl_ctrl.target_kl"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="known: \\['adaptive', 'fixed'\\]"):
        make_kl_controller("pid", 0.1)


def test_apply_kl_penalty_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.zeros(2, 3)
    ref = torch.tensor([[-1.0, 0.0, -0.5], [0.5, 0.0, 7.0]])  # k1 = old - ref
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_type="k1")
    # kl row0 = [1, 0, 0.5], row1 = [-0.5, 0, pad]
    assert rewards[0].tolist() == pytest.approx([-0.1, 0.0, 0.95])
    assert rewards[1].tolist() == pytest.approx([0.05, 2.0, 0.0])
    current = (1.5 / 3 + -0.5 / 2) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)  # the coefficient used
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 100))  # then updated, n_steps = B = 2


def test_diagnostics_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 3.0], [3.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # residual [0,0,0,1]: var (ddof=1) 0.25; returns [1,2,3,4]: var 5/3
    assert explained_variance(values, returns, mask).item() == pytest.approx(1 - 0.25 / (5 / 3))
    assert math.isnan(explained_variance(values, torch.ones(2, 3), mask).item())
    # returns equal up to fp32 rounding count as constant too, not as a ratio of -1e14
    noise = torch.tensor([[0.0, 1e-8, -1e-8], [2e-8, 0.0, 0.0]])
    assert math.isnan(explained_variance(values, noise, mask).item())
    assert math.isnan(explained_variance(values, 1000.0 + noise * 1e5, mask).item())  # std 1e-3 on 1000
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(0.5), math.log(1.1), math.log(1.5), 0.0]])
    kl = approx_kl(new, old, torch.ones(1, 4))
    assert kl["k1"].item() == pytest.approx(-(math.log(0.5) + math.log(1.1) + math.log(1.5)) / 4)
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.1, 1.5, 1.0)]
    assert kl["k3"].item() == pytest.approx(sum(k3) / 4)
    assert clipfrac(new, old, torch.ones(1, 4), 0.2, 0.2).item() == pytest.approx(2 / 4)
