"""HostOffload: where parameters and optimizer state rest between engine calls (verl's
param_offload / optimizer_offload), and which moves each call makes. The moves are recorded, not
made: this machine has no GPU, and on CPU nothing moves (checked last)."""
from __future__ import annotations

import pytest
import torch

from workers.engines.offload import HostOffload

GPU = torch.device("cuda", 0)  # a device object only; nothing is allocated on it


def _memory(params: bool, optimizer: bool, device=GPU):
    moves = []
    memory = HostOffload(device, lambda t: moves.append(("params", t.type)),
                         lambda t: moves.append(("optimizer", t.type)),
                         params_rest_on_host=params, optimizer_rest_on_host=optimizer)
    memory.rest()  # what an engine does once built
    return memory, moves


def _train_step(memory):
    """The order of FSDPEngine/MegatronEngine.train_batch."""
    with memory.params_on_device():
        memory.optimizer_on_device()  # just before optimizer.step()


def test_both_offloaded_each_call_brings_in_only_what_it_needs_and_puts_it_back():
    memory, moves = _memory(params=True, optimizer=True)
    assert moves == [("params", "cpu"), ("optimizer", "cpu")]
    moves.clear()
    with memory.params_on_device():  # a log-prob pass: the optimizer state stays in host memory
        assert (memory.params_on_host, memory.optimizer_on_host) == (False, True)
    assert moves == [("params", "cuda"), ("params", "cpu")]
    moves.clear()
    _train_step(memory)
    assert moves == [("params", "cuda"), ("optimizer", "cuda"), ("params", "cpu"), ("optimizer", "cpu")]


def test_no_offload_moves_only_for_generation_and_back():
    memory, moves = _memory(params=False, optimizer=False)
    _train_step(memory)
    with memory.params_on_device():
        pass
    assert moves == []
    memory.offload()  # generation mode, then back to rest
    memory.rest()
    assert moves == [("params", "cpu"), ("optimizer", "cpu"), ("params", "cuda"), ("optimizer", "cuda")]


def test_optimizer_offload_alone_moves_the_state_around_the_step_only():
    memory, moves = _memory(params=False, optimizer=True)
    assert moves == [("optimizer", "cpu")]
    moves.clear()
    with memory.params_on_device():
        pass
    _train_step(memory)
    assert moves == [("optimizer", "cuda"), ("optimizer", "cpu")]


def test_generation_mode_offloads_what_rests_on_device_and_a_weight_stream_brings_params_in():
    memory, moves = _memory(params=True, optimizer=False)
    moves.clear()
    with memory.params_on_device():  # resharding/switch.py: the stream reads the parameters
        pass
    memory.offload()
    memory.rest()
    assert moves == [("params", "cuda"), ("params", "cpu"), ("optimizer", "cpu"), ("optimizer", "cuda")]


def test_an_error_inside_a_call_still_returns_to_rest():
    memory, moves = _memory(params=True, optimizer=True)
    with pytest.raises(RuntimeError):
        with memory.params_on_device():
            memory.optimizer_on_device()
            raise RuntimeError("a failing step")
    assert (memory.params_on_host, memory.optimizer_on_host) == (True, True)


def test_on_cpu_nothing_moves():
    memory, moves = _memory(params=True, optimizer=True, device=torch.device("cpu"))
    _train_step(memory)
    memory.offload()
    assert moves == [] and not memory.active
