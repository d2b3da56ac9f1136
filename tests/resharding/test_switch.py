"""generate_mode: call order, separate RNG streams, metrics, and cleanup on errors."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from resharding.switch import RNGStreams, generate_mode
from resharding.transfer import TransferStats


class Recorder:
    """Stands in for the engine and rollout: records which hooks ran, in order."""

    def __init__(self, log, name, consume=None):
        self.log, self.name, self.consume, self.loaded = log, name, consume, []

    def __getattr__(self, method):
        if method in ("offload", "onload", "resume_memory", "release_memory"):
            return lambda: self.log.append(f"{self.name}.{method}")
        raise AttributeError(method)

    @contextmanager
    def params_on_device(self):  # an engine whose parameters may rest in host memory
        self.log.append(f"{self.name}.params_in")
        yield
        self.log.append(f"{self.name}.params_back")

    def update_weights(self, weights):
        self.log.append("rollout.update_weights")
        for i, item in enumerate(weights):
            if self.consume is not None and i == self.consume:
                break  # a consumer that stops early must not leave peers waiting
            self.loaded.append(item[0])


def make_weights(log, stats):
    def stream():
        for name in ("a", "b", "c"):
            stats.bytes_received += 10
            yield name, torch.zeros(1)
        log.append("stream.done")
    return stream


def test_call_order_metrics_and_early_stopping_consumer():
    log, stats = [], TransferStats()
    engine, rollout = Recorder(log, "engine"), Recorder(log, "rollout", consume=1)
    with generate_mode(engine, rollout, make_weights(log, stats), stats=stats) as metrics:
        log.append("generate")
    assert log == ["rollout.resume_memory", "engine.params_in", "rollout.update_weights", "stream.done",
                   "engine.params_back", "engine.offload", "generate", "rollout.release_memory", "engine.onload"]
    assert rollout.loaded == ["a"]
    assert metrics["reshard/bytes"] == 30 and metrics["timing_s/reshard"] >= 0


def test_generation_and_training_rng_streams_do_not_mix():
    torch.manual_seed(0)
    train_ref = torch.rand(4)
    torch.manual_seed(123)
    gen_ref = torch.rand(4)

    torch.manual_seed(0)
    rng, log = RNGStreams(generation_seed=123), []
    train, gen = [torch.rand(1)], []
    for _ in range(3):
        with generate_mode(Recorder(log, "engine"), Recorder(log, "rollout"), make_weights(log, TransferStats()),
                           rng=rng):
            gen.append(torch.rand(1))
        train.append(torch.rand(1))
    assert torch.equal(torch.cat(train), train_ref)
    assert torch.equal(torch.cat(gen), gen_ref[:3])
    # a restored stream continues where the saved one stopped
    rng2 = RNGStreams(0)
    rng2.load_state_dict(rng.state_dict())
    with generate_mode(Recorder(log, "engine"), Recorder(log, "rollout"), make_weights(log, TransferStats()), rng=rng2):
        assert torch.equal(torch.rand(1), gen_ref[3:])


def test_error_in_generation_still_restores_training_state():
    log, rng = [], RNGStreams(5)
    torch.manual_seed(1)
    expected = torch.rand(1)
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="boom"):
        with generate_mode(Recorder(log, "engine"), Recorder(log, "rollout"), make_weights(log, TransferStats()),
                           rng=rng):
            torch.rand(5)
            raise RuntimeError("boom")
    assert log[-2:] == ["rollout.release_memory", "engine.onload"]
    assert torch.equal(torch.rand(1), expected)
