"""Switch a hybrid worker between training and generation (the 3D-HybridEngine's transition).

Entering ``generate_mode``: switch to the generation RNG stream, wake the rollout, stream the
weights into it, then offload the training engine (the stream reads the engine's parameters, so
offloading comes after it). Leaving: free the rollout, bring the engine back, switch back to the
training RNG stream. Sampling therefore never perturbs dropout/init randomness of training and
vice versa, and a resumed run reproduces both streams.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Iterator

import torch

from hybridflow import device
from resharding.transfer import TransferStats, drain

WeightSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class RNGStreams:
    """Two torch RNG states (CPU and, on GPU, the device's) kept apart: training and generation.

    The generation stream starts from ``generation_seed`` the first time it is entered.
    ``state_dict``/``load_state_dict`` let checkpoints carry both streams.
    """

    def __init__(self, generation_seed: int):
        self.generation_seed = generation_seed
        self._generation: dict | None = None
        self._training: dict | None = None

    def to_generation(self) -> None:
        self._training = device.rng_state()
        if self._generation is None:
            torch.manual_seed(self.generation_seed)
        else:
            device.set_rng_state(self._generation)

    def to_training(self) -> None:
        self._generation = device.rng_state()
        if self._training is not None:
            device.set_rng_state(self._training)
            self._training = None

    def state_dict(self) -> dict:
        return {"generation_seed": self.generation_seed, "generation": self._generation}

    def load_state_dict(self, state: dict) -> None:
        self.generation_seed, self._generation = state["generation_seed"], state["generation"]


def _call(obj, method: str) -> None:
    fn = getattr(obj, method, None)
    if callable(fn):
        fn()


def _params_on_device(engine):
    fn = getattr(engine, "params_on_device", None)
    return fn() if callable(fn) else nullcontext()


@contextmanager
def generate_mode(engine, rollout, weights: WeightSource, metrics: dict | None = None,
                  rng: RNGStreams | None = None, stats: TransferStats | None = None,
                  offload_engine: bool = True) -> Iterator[dict]:
    """Put this worker in generation mode for the ``with`` body; yields ``metrics``.

    ``weights()`` returns the stream to load, e.g. ``lambda: resharder.stream(local_params)``
    (Megatron) or ``lambda: fsdp_weights.stream(model.named_parameters())`` (FSDP);
    ``stats`` is the TransferStats that stream fills (``resharder.stats``, ``fsdp_weights.stats``).
    Records ``timing_s/reshard`` (wake + stream + load), ``reshard/transfer_s`` (the part spent
    moving weights between ranks, the rest being the rollout's own load) and ``reshard/bytes``
    (bytes this rank received from other ranks; ``reshard/bytes_sent`` too). The engine is
    offloaded only if it has ``offload``/``onload`` and ``offload_engine`` is set.
    """
    metrics = {} if metrics is None else metrics
    start = time.perf_counter()
    if rng is not None:
        rng.to_generation()
    try:
        _call(rollout, "resume_memory")
        # the stream reads the engine's parameters: on the device even where they rest in host
        # memory between calls (param_offload)
        with _params_on_device(engine):
            stream = iter(weights())
            try:
                rollout.update_weights(stream)
            finally:
                drain(stream)  # peers block in the stream's collectives until every rank finishes it
        if offload_engine:
            _call(engine, "offload")
        device.synchronize()
        metrics["timing_s/reshard"] = time.perf_counter() - start
        if stats is not None:
            metrics["reshard/bytes"] = stats.bytes_received
            metrics["reshard/bytes_sent"] = stats.bytes_sent
            metrics["reshard/transfer_s"] = stats.seconds
        yield metrics
    finally:
        _call(rollout, "release_memory")
        if offload_engine:
            _call(engine, "onload")
        if rng is not None:
            rng.to_training()
