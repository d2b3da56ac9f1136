"""Where a training engine's parameters and optimizer state rest between calls.

verl's ``param_offload`` / ``optimizer_offload`` (``fsdp_config`` of the actor, reference and
critic; ``megatron`` for that strategy): on a GPU, keep the parameters (with their gradients) and
the optimizer state (AdamW's moments, Megatron's fp32 master weights) in host memory while the
engine is idle, so the device memory goes to vLLM's KV cache and to the other engines colocated
on it (a frozen reference policy is the usual candidate). Each engine call brings in what it
needs and puts it back when it returns: a forward-only pass moves the parameters only, a
training step moves the optimizer state in just before ``optimizer.step()``.

Generation mode (``resharding/switch.py``) is separate: :meth:`HostOffload.offload` moves
everything out while vLLM runs whatever the keys say, :meth:`HostOffload.rest` returns to the
resting place after.

What differs from verl: on CPU the device *is* host memory, so nothing moves and both keys cost
nothing (they are accepted so that verl scripts run unchanged).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from hybridflow import device as hf_device

HOST = torch.device("cpu")
Move = Callable[[torch.device], None]


class HostOffload:
    """Tracks where parameters and optimizer state are; moves them only when that changes.

    ``move_params(target)`` / ``move_optimizer(target)`` do the engine-specific moves.
    """

    def __init__(self, device: torch.device, move_params: Move, move_optimizer: Move, *,
                 params_rest_on_host: bool, optimizer_rest_on_host: bool):
        self.device = device
        self.active = device.type != "cpu"  # host memory is the device: nothing to move
        self._move_params, self._move_optimizer = move_params, move_optimizer
        self.params_rest_on_host, self.optimizer_rest_on_host = params_rest_on_host, optimizer_rest_on_host
        self.params_on_host = self.optimizer_on_host = False

    def place(self, params_on_host: bool, optimizer_on_host: bool) -> None:
        if not self.active:
            return
        moved = freed = False
        if params_on_host != self.params_on_host:
            self._move_params(HOST if params_on_host else self.device)
            self.params_on_host, moved, freed = params_on_host, True, freed or params_on_host
        if optimizer_on_host != self.optimizer_on_host:
            self._move_optimizer(HOST if optimizer_on_host else self.device)
            self.optimizer_on_host, moved, freed = optimizer_on_host, True, freed or optimizer_on_host
        if moved:  # the moves are non-blocking; the next kernel or free must see them
            hf_device.synchronize()
        if freed:
            hf_device.empty_cache()

    def rest(self) -> None:
        """Back to where the config keeps things between calls."""
        self.place(self.params_rest_on_host, self.optimizer_rest_on_host)

    def offload(self) -> None:
        """Everything to host memory (generation mode)."""
        self.place(True, True)

    def optimizer_on_device(self) -> None:
        """For the optimizer step, inside :meth:`params_on_device`."""
        self.place(False, False)

    @contextmanager
    def params_on_device(self) -> Iterator[None]:
        """The parameters on the device for the body, then back to rest."""
        self.place(False, self.optimizer_on_host)
        try:
            yield
        finally:
            self.rest()

    @contextmanager
    def all_on_device(self) -> Iterator[None]:
        """Parameters and optimizer state on the device for the body (checkpoints), then rest."""
        self.place(False, False)
        try:
            yield
        finally:
            self.rest()
