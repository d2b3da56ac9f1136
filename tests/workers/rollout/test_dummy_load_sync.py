"""The hybrid worker with load_format=dummy syncs the actor's weights into vLLM before its first
generation (the trainer's step-0 validation included); with auto the engine already holds them.
Any change of the engine's weights, also by a method the worker does not know, syncs again.
The engine and the actor are test doubles here: the real dummy-then-sync generation is checked
against the auto engine's in test_vllm_rollout.py."""
import pytest
import torch

from hybridflow.protocol import DataProto
from workers import actor_rollout_ref
from workers.rollout import vllm_rollout
from workers.rollout.base import RolloutConfig


class _Actor:
    """The FSDP actor engine as the worker's weight stream sees it: an unsharded module, no LoRA."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.lora_scalings = {}
        self.weights_version = 0  # the engines count their weight changes


def _worker(monkeypatch, load_format: str, calls: list, actor=None):
    class Rollout:  # records what the worker asks of vLLM
        dp_rank, dp_size, is_collect = 0, 1, True

        def __init__(self, config, model_path):
            pass

        def update_weights(self, weights):
            calls.append(("sync", sorted(name for name, _ in weights)))

        def generate_sequences(self, prompts):
            calls.append("generate")
            return prompts

    monkeypatch.setattr(vllm_rollout, "VLLMRollout", Rollout)
    settings = actor_rollout_ref.ActorRolloutRefSettings(
        model_path="unused", rollout=RolloutConfig(load_format=load_format))
    worker = actor_rollout_ref.ActorRolloutRefWorker(settings)
    worker.engine = actor
    worker._build_rollout()
    return worker


@pytest.mark.parametrize("load_format,expected", [
    ("dummy", [("sync", ["bias", "weight"]), "generate", "generate"]),
    ("auto", ["generate", "generate"])])
def test_first_generation_syncs_only_a_dummy_loaded_engine(monkeypatch, load_format, expected):
    calls = []
    worker = _worker(monkeypatch, load_format, calls, _Actor())
    prompts = DataProto.from_dict({"input_ids": torch.ones(1, 2, dtype=torch.long)})
    for _ in range(2):  # the second call has nothing new to sync (no actor update in between)
        worker.generate_sequences(prompts)
    assert calls == expected


def test_dummy_load_without_an_actor_to_sync_from_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="load_format=dummy needs the actor's weights to sync into vLLM"):
        _worker(monkeypatch, "dummy", [], actor=None)


def test_weights_changed_by_a_custom_method_reach_vllm(monkeypatch):
    """A subclass's own training method (RAFT, SFT steps...) calls engine.train_batch, not
    update_actor: the engine's weights_version tells the worker to sync anyway (it generated from
    the old weights before, 0.8 apart in probability after one step)."""
    calls = []
    worker = _worker(monkeypatch, "auto", calls, _Actor())
    prompts = DataProto.from_dict({"input_ids": torch.ones(1, 2, dtype=torch.long)})
    worker.generate_sequences(prompts)
    worker.engine.weights_version += 1  # what the engine's train_batch does after an optimizer step
    worker.generate_sequences(prompts)
    worker.generate_sequences(prompts)
    assert calls == ["generate", ("sync", ["bias", "weight"]), "generate", "generate"]
