"""``trainer.placement=auto`` (hybridflow/placement/auto.py and the recipe's step before Ray): the
recipe plans, prints the chosen plan and the best alternatives with predicted step time and memory
on stderr, and runs the chosen plan's config; nothing is started to plan (the planning step alone)."""
import re

import pytest

from hybridflow.config import validate as real_validate
from tests.hybridflow.placement.test_from_config import CPU


@pytest.fixture
def fake_calibration(monkeypatch):
    """The machine's measured rates without measuring (calibrate.py's cache is tested apart)."""
    from hybridflow.placement import auto

    monkeypatch.setattr(auto, "device_calibration", lambda *a, **k: ({"device": CPU, "constants": {}}, "test cpu"))


def test_recipe_plans_prints_and_runs_the_chosen_plan(ppo_overrides, fake_calibration, monkeypatch, capsys):
    import recipes.main_ppo as main_ppo

    # the test's models are config.json alone: everything but the file checks
    monkeypatch.setattr(main_ppo, "validate", lambda cfg, **kw: real_validate(cfg, **{**kw, "check_paths": False}))
    monkeypatch.setattr(main_ppo, "available_slots", lambda cfg: 2)
    cfg = main_ppo.load_and_validate(["--config-name", "ppo", *ppo_overrides, "trainer.placement=auto"])
    err = capsys.readouterr().err
    assert cfg.trainer.placement in ("colocate", "separate")
    chosen = re.search(r"chosen:  ([\d.]+) s/step, peak ([\d.]+) GiB/slot: (.+)", err)
    assert chosen, err
    runs_as = re.search(r"runs as: (.+)", err).group(1).split()
    assert f"trainer.placement={cfg.trainer.placement}" in runs_as
    assert f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}" in runs_as
    alternatives = re.findall(r"^  (\d+)\.\s+([\d.]+) s/step, peak [\d.]+ GiB/slot: ", err, re.M)
    assert [int(n) for n, _ in alternatives] == list(range(2, 2 + len(alternatives))) and len(alternatives) >= 2
    times = [float(chosen.group(1))] + [float(t) for _, t in alternatives]
    assert times == sorted(times)  # the chosen is the fastest predicted; alternatives follow in order


def test_choice_is_the_fastest_runnable_plan(ppo_overrides, fake_calibration):
    from hybridflow.config import load_config
    from hybridflow.placement.auto import plan_config, report
    from recipes.cli import compose_config

    cfg = load_config(compose_config("ppo", ppo_overrides + ["trainer.placement=auto"]))
    auto = plan_config(cfg)
    assert auto.chosen.estimate.step_s == min(c.estimate.step_s for c in auto.candidates)
    text = report(auto, top=2)
    assert text.count("s/step") == 3 and "chosen:" in text


def test_on_gpus_the_datasheet_profile_of_the_card_is_planned_on(ppo_overrides, monkeypatch):
    from hybridflow import device
    from hybridflow.config import ConfigError, load_config
    from hybridflow.placement.auto import plan_config
    from recipes.cli import compose_config

    cfg = load_config(compose_config("ppo", ppo_overrides + ["trainer.placement=auto"]))
    monkeypatch.setattr(device, "uses_gpu", lambda requested: True)
    monkeypatch.setattr(device, "device_count", lambda: 8)
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    auto = plan_config(cfg)
    assert "H100" in auto.device and sum(p.slots for p in auto.chosen.estimate.plan.pools) == 8
    monkeypatch.setattr(device, "device_name", lambda: "Tesla T4")
    with pytest.raises(ConfigError, match="no device profile for GPU 'tesla t4'"):
        plan_config(cfg)
