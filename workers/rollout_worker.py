"""The rollout pool's worker: vLLM generation only, on slots apart from the trainer's.

Unlike the hybrid worker (workers/actor_rollout_ref.py) it holds no training engine and shares no
torch.distributed world with the trainer: the trainer pool is another world. Weights therefore
come in as a ``StagedWeights`` (resharding/staging.py) that the trainer's rank 0 put into Ray's
object store (``ActorRolloutRefWorker.stage_weights``): every rollout rank reads each bucket (on
the trainer's host straight from shared memory, elsewhere Ray copies it over), and vLLM's loader
takes the shard of each full tensor its TP rank needs. Every sync carries a version, and every
generated row records the version that wrote it (``rollout_weight_version``). With partial
rollout a generation also takes weights posted on the run's weight board while it runs
(``BoardSwitch``), and the load queued behind it then finds them there already.

Seeding is the hybrid worker's (``seed + rank`` for torch, generation stream ``seed + 1000 *
dp_rank``, vLLM's ``rollout.seed + dp_rank``): given the same weights and prompts both generate
the same tokens, which is what makes staleness 0 on two pools equal the synchronous run.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from hybridflow import device
from hybridflow.checkpoint_files import CheckpointError, load_tensors, plain_rng_state, set_plain_rng_state
from hybridflow.controller import Dispatch, Worker, register, spans
from hybridflow.model_overrides import import_external_lib
from hybridflow.protocol import DataProto
from resharding.staging import StagedWeights, pack_buckets, unpack_bucket
from workers.rollout.base import RolloutConfig
from workers.stream_rollout import StreamingRollout

ROLLOUT_STATE = "rollout_worker_rank{rank}.pt"
VERSION_KEY = "rollout_weight_version"
_DTYPE_ALIASES = {"half": torch.float16, "float": torch.float32}


def rollout_torch_dtype(dtype: str, model_path: str, hf_overrides: dict | None = None) -> torch.dtype | None:
    """The torch dtype a vLLM engine of ``rollout.dtype`` holds weights in (``auto``: the
    checkpoint's, as VLLMRollout resolves it); None when the checkpoint names none."""
    from hybridflow.model_overrides import load_hf_config
    from workers.rollout.vllm_rollout import _engine_dtype

    if dtype == "auto":
        dtype = _engine_dtype(dtype, load_hf_config(model_path, hf_overrides))
        if dtype == "auto":
            return None
    resolved = _DTYPE_ALIASES.get(dtype, getattr(torch, dtype, None))
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"rollout.dtype={dtype!r} is not a torch dtype vLLM accepts (e.g. bfloat16, float32)")
    return resolved


def stage_to_object_store(weights, version: int, bucket_bytes: int, cast_to: torch.dtype | None,
                          pack: bool) -> StagedWeights | None:
    """Consume the full-tensor stream ``weights``; with ``pack`` put it into Ray's object store as
    buckets and return the ``StagedWeights``, else only run the stream (its collectives) to the end.

    Each bucket goes in as a numpy uint8 array, which Ray stores out of band: a reader on this host
    maps it from shared memory without a copy. The packed bucket is dropped once it is stored, so at
    most one bucket of packed bytes lives outside the store."""
    import ray

    from resharding.transfer import drain

    start = time.perf_counter()
    stream = iter(weights)
    try:
        if not pack:
            return None
        refs, headers = [], []
        for header, buffer in pack_buckets(stream, bucket_bytes, cast_to):
            refs.append(ray.put(buffer.numpy()))
            headers.append(header)
            del buffer
        return StagedWeights(version=int(version), buckets=tuple(refs), headers=tuple(headers),
                             total_bytes=sum(h.nbytes for h in headers), seconds=time.perf_counter() - start)
    finally:
        drain(stream)  # peers block in the stream's collectives until every rank finishes it


def staged_tensors(staged: StagedWeights, timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The staged tensors, one bucket fetched at a time (views of the fetched buffer, read-only)."""
    import ray

    for b, (ref, header) in enumerate(zip(staged.buckets, staged.headers)):
        try:
            buffer = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"weight sync: bucket {b + 1}/{len(staged.buckets)} of version {staged.version} did "
                               f"not arrive within {timeout_s:g}s (RolloutWorkerSettings.weight_fetch_timeout_s)") from None
        except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError) as err:
            raise RuntimeError(f"weight sync: bucket {b + 1}/{len(staged.buckets)} of version {staged.version} is "
                               f"gone: the trainer rank that staged it died or freed it ({type(err).__name__})") from None
        yield from unpack_bucket(header, buffer)
        del buffer


class BoardSwitch:
    """Partial rollout's ``switch`` (workers/rollout/vllm_partial.py) on a weight board: offers the
    newest version posted there once it is newer than what the engine holds; ``version`` is the
    last one offered. One small remote call per poll, a second only when the version moved."""

    def __init__(self, board, version: int, timeout_s: float):
        self.board, self.version, self.timeout_s = board, int(version), timeout_s

    def __call__(self):
        import ray

        if ray.get(self.board.version.remote(), timeout=self.timeout_s) <= self.version:
            return None
        staged = ray.get(self.board.latest.remote(), timeout=self.timeout_s)
        self.version = staged.version
        return staged.version, lambda: staged_tensors(staged, self.timeout_s)


def row_versions(out: DataProto, version: int) -> torch.Tensor:
    """Per row, the oldest weight version that wrote any of its tokens: ``version`` unless partial
    rollout's per-token versions (-1 at padding) say otherwise."""
    from workers.rollout.vllm_partial import TOKEN_VERSIONS

    if TOKEN_VERSIONS not in out.batch.keys():
        return torch.full((len(out),), version, dtype=torch.int64)
    tokens = out.batch[TOKEN_VERSIONS].to(torch.int64)
    return torch.where(tokens >= 0, tokens, torch.iinfo(torch.int64).max).min(dim=1).values.clamp(max=version)


@dataclass
class RolloutWorkerSettings:
    model_path: str
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    # verl's model.external_lib: imported before the engine is built (it may register the
    # checkpoint's architecture with transformers)
    external_lib: str | None = None
    weight_fetch_timeout_s: float = 600.0  # per bucket: a trainer that stops answering fails the sync


class RolloutWorker(StreamingRollout, Worker):
    """One slot of the rollout pool: a vLLM engine (per generation TP group) and its RNG streams."""

    def __init__(self, settings: RolloutWorkerSettings):
        super().__init__()
        if settings.rollout.name != "vllm":
            raise ValueError(f"a rollout pool of its own runs vLLM only (rollout.name={settings.rollout.name!r}); "
                             "rollout.name=hf generates with the actor's module and needs the hybrid engine")
        self.s = settings
        self.rollout = self.rng = None
        # the version of the weights the engine holds; None: none to generate with (a dummy load, or
        # a resumed checkpoint, before the first load_weights)
        self.weight_version: int | None = None
        self._switched_to: int | None = None  # the version a partial rollout's switch loaded last

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from resharding import RNGStreams
        from workers.rollout.vllm_rollout import VLLMRollout

        s = self.s
        import_external_lib(s.external_lib)
        self.init_distributed()
        torch.manual_seed(s.seed + self.rank)
        self.rollout = VLLMRollout(s.rollout, s.model_path)
        self.register_mesh("rollout", self.rollout.dp_rank, self.rollout.dp_size, self.rollout.is_collect)
        self.rng = RNGStreams(generation_seed=s.seed + 1000 * self.rollout.dp_rank)
        self.weight_version = None if s.rollout.load_format == "dummy" else 0  # 0: the checkpoint's
        return True

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=Dispatch.mesh("rollout"))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The hybrid worker's generation (its RNG stream, its metrics) plus, per output row, the
        weight version that generated it (int64 ``rollout_weight_version``).

        Partial rollout: with ``meta_info["weight_board"]`` (controller/weight_board.py) the engine
        takes weights posted there while it generates (workers/rollout/vllm_partial.py); a row's
        version is then the oldest that wrote any of its tokens, ``rollout_token_versions`` has each
        token's, and the engine keeps the newest weights it took."""
        self._check_weights("generate_sequences")
        board = prompts.meta_info.pop("weight_board", None)
        switch = BoardSwitch(board, self.weight_version, self.s.weight_fetch_timeout_s) if board is not None else None
        metrics: dict[str, float] = {}
        self.rng.to_generation()
        try:
            t0 = time.perf_counter()
            if switch is None:
                out = self.rollout.generate_sequences(prompts)
            else:
                out = self.rollout.generate_sequences(prompts, switch=switch, version=self.weight_version)
            metrics["timing_s/gen_worker"] = time.perf_counter() - t0
        except BaseException:
            if switch is not None and switch.version != self.weight_version:
                self.weight_version = None  # a switch began: which weights the engine holds is unknown
            raise
        finally:
            self.rng.to_training()
        if switch is not None and switch.version != self.weight_version:
            self.weight_version = self._switched_to = switch.version
        metrics.update(out.meta_info.pop("metrics", {}))
        out.batch[VERSION_KEY] = row_versions(out, self.weight_version)
        out.meta_info["metrics"] = metrics
        return out

    def _check_weights(self, what: str) -> None:
        if self.weight_version is None:
            raise RuntimeError(f"RolloutWorker.{what}: the engine holds no weights to generate with "
                               "(rollout.load_format=dummy, or just resumed): call load_weights first")

    # streaming generation's hooks (workers/stream_rollout.py). A stream takes no partial-rollout
    # weight switch: it generates with the version loaded when it opened (load_weights waits for
    # its end), and every row it returns carries that version.
    def _enter_generation(self, metrics: dict) -> None:
        self._check_weights("stream_start")
        self.rng.to_generation()

    def _leave_generation(self) -> None:
        self.rng.to_training()

    def _stream_rows(self, rows: DataProto) -> None:
        rows.batch[VERSION_KEY] = torch.full((len(rows),), self.weight_version, dtype=torch.int64)

    # ------------------------------------------------------------------ weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, staged: StagedWeights) -> dict[str, float]:
        """Load a staged version into the engine, one bucket in memory at a time. Refused while a
        stream session is open (streams take no weight switch)."""
        if self._stream is not None:
            raise RuntimeError("RolloutWorker.load_weights: a stream session is open on this worker; its rows "
                               "would mix weight versions. Step it to the end or stream_export it first")
        with spans.span("weight_sync"):  # the timeline names it as the hybrid worker's sync
            start = time.perf_counter()
            if staged.version == self._switched_to == self.weight_version:  # partial rollout took it already
                return {"timing_s/weight_sync_load": 0.0, "weight_sync/bytes": 0.0,
                        "weight_sync/version": float(staged.version)}
            self.rollout.resume_memory()
            self.weight_version = None  # a load that fails half-way leaves no version to generate with
            self.rollout.update_weights(staged_tensors(staged, self.s.weight_fetch_timeout_s))
            device.synchronize()
            self.weight_version = staged.version
            return {"timing_s/weight_sync_load": time.perf_counter() - start,
                    "weight_sync/bytes": float(staged.total_bytes), "weight_sync/version": float(staged.version)}

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> bool:
        """This rank's RNG (python, numpy, torch and the generation stream) and the loaded weight
        version, in one file. The weights are the trainer's to checkpoint: they come back by the
        next load_weights."""
        os.makedirs(path, exist_ok=True)
        state = {**plain_rng_state(), "torch": device.rng_state(), "rollout": self.rng.state_dict(),
                 "weight_version": self.weight_version}
        file = os.path.join(path, ROLLOUT_STATE.format(rank=self.rank))
        torch.save(state, file + ".tmp")
        os.replace(file + ".tmp", file)  # a kill mid-write leaves the previous file, never half of one
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int | None:
        """Restore this rank's RNG streams; returns the weight version the checkpoint was generating
        with. The engine still holds other weights, so generation waits for the next load_weights."""
        file = os.path.join(path, ROLLOUT_STATE.format(rank=self.rank))
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing: the checkpoint was saved by fewer rollout workers or is damaged")
        state = load_tensors(file)
        set_plain_rng_state(state)
        device.set_rng_state(state["torch"])
        self.rng.load_state_dict(state["rollout"])
        self.weight_version = None
        return state["weight_version"]
