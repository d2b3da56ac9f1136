"""model.external_lib is imported in the worker process before the worker builds any model (a module
that registers an architecture with transformers must be in place there, not only in the driver).
The engines are test doubles: each records whether the module was imported when it was built."""
import sys

import pytest

from workers import actor_rollout_ref, critic
from workers.engines.config import EngineConfig

LIB = "hf_test_worker_lib"


class _Engine:
    dp_rank, dp_size, is_collect = 0, 1, True

    def __init__(self, built: list, role: str):
        built.append((role, LIB in sys.modules))


@pytest.fixture
def lib(tmp_path, monkeypatch):
    (tmp_path / f"{LIB}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH (or Ray's copy of the driver's cwd) gives a worker
    sys.modules.pop(LIB, None)
    yield LIB
    sys.modules.pop(LIB, None)


@pytest.fixture
def built(monkeypatch) -> list:
    built = []
    for module in (actor_rollout_ref, critic):
        monkeypatch.setattr(module, "build_engine", lambda cfg, path, role: _Engine(built, role))
    monkeypatch.setattr(actor_rollout_ref.Worker, "init_distributed", lambda self: None)
    return built


def test_actor_rollout_ref_worker_imports_it_before_its_models(lib, built):
    settings = actor_rollout_ref.ActorRolloutRefSettings(model_path="unused", roles=("actor", "ref"), external_lib=lib)
    actor_rollout_ref.ActorRolloutRefWorker(settings).init_model()
    assert built == [("actor", True), ("ref", True)]


def test_reward_model_worker_imports_it_before_its_model(lib, monkeypatch):
    import transformers

    from workers import reward_model

    class Built(Exception):
        pass

    def from_pretrained(path, **kwargs):
        raise Built(LIB in sys.modules)

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", from_pretrained)
    monkeypatch.setattr(reward_model.Worker, "init_distributed", lambda self: None)
    settings = reward_model.RewardModelSettings(model_path="unused", external_lib=lib)
    with pytest.raises(Built) as built:
        reward_model.RewardModelWorker(settings).init_model()
    assert built.value.args == (True,)


def test_critic_worker_imports_it_before_its_model(lib, built):
    settings = critic.CriticSettings(model_path="unused", engine=EngineConfig(), external_lib=lib)
    critic.CriticWorker(settings).init_model()
    assert built == [("critic", True)]
