"""The hybrid worker: actor (training engine), rollout (vLLM or HF) and reference policy in one
process per slot, sharing the slot's device and the group's torch.distributed world.

Two data-parallel meshes are registered with the controller: ``actor`` (the training layout's
dp rank; collected from TP rank 0 of the last pipeline stage) and ``rollout`` (generation dp =
world / rollout TP). Between an actor update and the next generation the weights move from the
training layout to the generation layout through ``resharding`` (the 3D-HybridEngine); nothing is
copied when the weights did not change.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from hybridflow import device
from hybridflow.algorithms.objectives import ActorObjective
from hybridflow.controller import Dispatch, Worker, register, spans
from hybridflow.model_overrides import import_external_lib
from hybridflow.protocol import DataProto
from workers import ppo_update
from workers.engines.config import EngineConfig
from workers.fused_update import FusedActorCriticUpdate
from workers.rollout.base import RolloutConfig
from workers.stream_rollout import StreamingRollout

ROLES = ("actor", "rollout", "ref")


@dataclass
class ActorRolloutRefSettings:
    model_path: str
    roles: tuple[str, ...] = ("actor", "rollout")
    actor: EngineConfig = field(default_factory=EngineConfig)
    ref: EngineConfig | None = None
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ActorObjective = field(default_factory=ActorObjective)
    ppo_mini_batch_size: int = 8  # rows (sequences) per optimizer step, over all dp ranks
    ppo_epochs: int = 1
    shuffle: bool = False
    temperature: float = 1.0  # the sampling temperature; log-probs are computed under it too
    reshard_bucket_bytes: int = 64 * 1024**2
    seed: int = 0
    # verl's model.external_lib: imported before any model is built (it may register the
    # checkpoint's architecture with transformers, which this process must see too)
    external_lib: str | None = None


def build_engine(cfg: EngineConfig, model_path: str, role: str):
    if cfg.strategy == "fsdp":
        from workers.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, model_path, role)
    if cfg.strategy == "megatron":
        from workers.engines.megatron import MegatronEngine

        return MegatronEngine(cfg, model_path, role)
    raise ValueError(f"actor_rollout_ref.actor.strategy={cfg.strategy!r}: use 'fsdp' or 'megatron'")


class ActorRolloutRefWorker(StreamingRollout, FusedActorCriticUpdate, Worker):
    def __init__(self, settings: ActorRolloutRefSettings):
        super().__init__()
        unknown = set(settings.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"ActorRolloutRefWorker roles {sorted(unknown)} unknown; use a subset of {ROLES}")
        self.s = settings
        self.engine = self.ref_engine = self.rollout = None
        self._weights_stale = False
        self._staging_source = None  # the full-tensor stream stage_weights reads, built on first use

    # ------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        import_external_lib(self.s.external_lib)
        self.init_distributed()
        torch.manual_seed(self.s.seed + self.rank)
        s = self.s
        if "actor" in s.roles:
            self.engine = build_engine(s.actor, s.model_path, "actor")
            self.register_mesh("actor", self.engine.dp_rank, self.engine.dp_size, self.engine.is_collect)
        if "ref" in s.roles and self.engine is not None and s.actor.lora_rank:
            self.ref_engine = self.engine  # LoRA: the reference is the actor with its adapters off
        elif "ref" in s.roles:
            self.ref_engine = build_engine(s.ref or s.actor, s.model_path, "ref")
            if self.engine is None:
                self.register_mesh("actor", self.ref_engine.dp_rank, self.ref_engine.dp_size,
                                   self.ref_engine.is_collect)
        if "rollout" in s.roles:
            self._build_rollout()
        return True

    def _build_rollout(self):
        from resharding import RNGStreams

        s = self.s
        if s.rollout.name == "vllm":
            from workers.rollout.vllm_rollout import VLLMRollout

            self.rollout = VLLMRollout(s.rollout, s.model_path)
        else:
            from workers.rollout.hf_rollout import HFRollout

            if self.engine is None or s.actor.strategy != "fsdp":
                raise ValueError("actor_rollout_ref.rollout.name=hf generates with the actor's own module and needs "
                                 "actor.strategy=fsdp; use rollout.name=vllm with megatron")
            self.rollout = HFRollout(self.engine.model, s.rollout, sync_ranks=self.world_size > 1)
        self.register_mesh("rollout", self.rollout.dp_rank, self.rollout.dp_size, self.rollout.is_collect)
        self.rng = RNGStreams(generation_seed=s.seed + 1000 * self.rollout.dp_rank)
        self._weight_source, self._stats = self._make_weight_source()
        self._synced_version = self.engine.weights_version if self.engine is not None else 0
        # vLLM's dummy load leaves random weights, and generation syncs only after an actor update:
        # mark them stale so the first generation (step 0's validation too) syncs first
        if s.rollout.name == "vllm" and s.rollout.load_format == "dummy":
            if self._weight_source is None:
                raise ValueError("actor_rollout_ref.rollout.load_format=dummy needs the actor's weights to sync "
                                 "into vLLM, and this worker has none: use load_format=auto")
            self._weights_stale = True

    def _make_weight_source(self):
        """How this rank streams the actor's weights into the rollout (the resharding plan)."""
        s = self.s
        if self.engine is None or s.rollout.name == "hf":
            return None, None
        return self._full_weights_source(s.rollout.tensor_model_parallel_size)

    def _full_weights_source(self, generation_tp: int):
        """(source, stats): ``source()`` streams (HF name, full-size tensor) of the actor's weights on
        every rank, valid where a generation TP rank of ``generation_tp`` reads them (1: whole)."""
        from resharding import FSDPWeightStream, GenLayout, Resharder, TrainLayout, plan_from_param_specs

        s, engine = self.s, self.engine
        if s.actor.strategy == "megatron":
            from workers.models.layout import param_specs

            train = TrainLayout(pp=s.actor.pp, tp=s.actor.tp, dp=self.world_size // (s.actor.pp * s.actor.tp))
            gen = GenLayout(tp=generation_tp, world=self.world_size)
            resharder = Resharder(plan_from_param_specs(param_specs, engine.hf_config, train, gen),
                                  bucket_bytes=s.reshard_bucket_bytes)
            return (lambda: resharder.stream(dict(engine.model.named_parameters()))), resharder.stats
        from workers.engines.hf_export import in_checkpoint_layout
        from workers.engines.lora import merge_lora

        weights = FSDPWeightStream(s.reshard_bucket_bytes)
        # LoRA: vLLM gets plain HF weights with the adapters merged in (no adapter support needed);
        # vLLM's loaders read the checkpoint's layout, not transformers' runtime one (MoE experts)
        return (lambda: in_checkpoint_layout(engine.model, merge_lora(
            weights.stream(engine.model.named_parameters()), engine.lora_scalings))), weights.stats

    # ------------------------------------------------------------------ weights for a rollout pool
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stage_weights(self, version: int, dtype: str | None = None):
        """Hand the actor's current weights to a rollout pool of its own (a separate world).

        Every rank runs the full-tensor stream (its collectives need them all); rank 0 packs the
        tensors into buckets of ``reshard_bucket_bytes`` and puts each into Ray's object store,
        returning a ``StagedWeights`` (other ranks: None) for ``RolloutWorker.load_weights``.
        ``dtype``: the rollout engine's dtype (vLLM's names; None: ``rollout.dtype`` of these
        settings, ``auto`` being the checkpoint's); floating tensors are sent in it.
        """
        from workers.rollout_worker import rollout_torch_dtype, stage_to_object_store

        if self.engine is None:
            raise ValueError("stage_weights needs the actor role on this worker (roles include 'actor')")
        if self._staging_source is None:
            self._staging_source = self._full_weights_source(generation_tp=1)[0]
        cast_to = rollout_torch_dtype(self.s.rollout.dtype if dtype is None else dtype, self.s.model_path,
                                      self.s.rollout.hf_overrides)
        with self.engine.params_on_device():  # param_offload: the stream reads the parameters
            return stage_to_object_store(self._staging_source(), version, self.s.reshard_bucket_bytes, cast_to,
                                         pack=self.rank == 0)

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=Dispatch.mesh("rollout"))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        metrics: dict[str, float] = {}
        with ExitStack() as generating:
            self._generation_mode(generating, metrics)
            out = self._generate(prompts, metrics)
        out.meta_info["metrics"] = metrics
        return out

    def _generation_mode(self, stack: ExitStack, metrics: dict) -> None:
        """Put this worker in generation mode until ``stack`` closes: the actor's weights synced
        into the rollout if stale (resharding's generate_mode, its metrics into ``metrics``), the
        generation RNG stream. Shared by generate_sequences and a stream's session."""
        from resharding import generate_mode

        # stale: set by this worker's own updates and loads, and seen from the engine's version for
        # any other method that trains it (a subclass's custom update), so no sync is forgotten
        if self._weight_source is not None and (self._weights_stale or
                                                self.engine.weights_version != self._synced_version):
            self._stats.reset()
            with spans.span("weight_sync"):  # the timeline shows the sync apart from generation
                stack.enter_context(generate_mode(
                    self.engine, self.rollout, self._weight_source, metrics, self.rng, self._stats,
                    offload_engine=device.device_type() == "cuda"))
            # the rollout holds these weights now (a generation failing after the sync keeps them)
            self._weights_stale = False
            self._synced_version = self.engine.weights_version
        else:
            # asleep (GPU) since the last generation's end, e.g. a stream's session reopened by adopt
            getattr(self.rollout, "resume_memory", lambda: None)()
            self.rng.to_generation()
            stack.callback(self.rng.to_training)

    # streaming generation's hooks (workers/stream_rollout.py): generation mode kept across calls
    def _enter_generation(self, metrics: dict) -> None:
        stack = ExitStack()
        self._generation_mode(stack, metrics)
        self._generating = stack

    def _leave_generation(self) -> None:
        stack, self._generating = getattr(self, "_generating", None), None
        if stack is not None:
            stack.close()

    def _generate(self, prompts: DataProto, metrics: dict) -> DataProto:
        t0 = time.perf_counter()
        out = self.rollout.generate_sequences(prompts)
        metrics["timing_s/gen_worker"] = time.perf_counter() - t0
        # the rollout's own (vLLM's perf/gen_tail_share), kept: generate_sequences sets the dict whole
        metrics.update(out.meta_info.pop("metrics", {}))
        return out

    # ------------------------------------------------------------------ log-probs
    @register(dispatch_mode=Dispatch.mesh("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        return self._old_log_probs(data, local=False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_log_prob_local(self, data: DataProto) -> DataProto:
        """compute_log_prob of ``data`` on this rank alone, no collective (workers/engines/local_infer.py):
        a rank freed from generation runs it while the others still generate. Raises where the
        layout needs other ranks (``local_inference_ok``)."""
        return self._old_log_probs(data, local=True)

    @register(dispatch_mode=Dispatch.mesh("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        return self._ref_log_probs(data, local=False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_ref_log_prob_local(self, data: DataProto) -> DataProto:
        """compute_ref_log_prob of ``data`` on this rank alone (as compute_log_prob_local)."""
        return self._ref_log_probs(data, local=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_inference_ok(self) -> bool:
        """Whether every training engine of this worker can run the ``*_local`` calls alone."""
        from workers.engines.local_infer import local_inference_block

        return all(local_inference_block(e) is None for e in (self.engine, self.ref_engine) if e is not None)

    def _log_probs(self, engine, data: DataProto, entropy: bool, local: bool):
        from workers.engines.local_infer import local_log_prob

        temperature = float(data.meta_info.get("temperature", self.s.temperature))
        if local:
            return local_log_prob(engine, data, temperature, entropy)
        return engine.compute_log_prob(data, temperature, calculate_entropy=entropy)

    def _old_log_probs(self, data: DataProto, local: bool) -> DataProto | None:
        log_probs, entropy = self._log_probs(self.engine, data, True, local)
        if not (local or self.engine.is_collect):
            return None
        return DataProto.from_dict({"old_log_probs": log_probs.float(), "entropys": entropy.float()})

    def _ref_log_probs(self, data: DataProto, local: bool) -> DataProto | None:
        if self.ref_engine is self.engine:  # LoRA: the frozen base weights are the reference policy
            from workers.engines.lora import adapters_disabled

            with adapters_disabled(self.engine.model):
                log_probs, _ = self._log_probs(self.engine, data, False, local)
        else:
            log_probs, _ = self._log_probs(self.ref_engine, data, False, local)
        if not (local or self.ref_engine.is_collect):
            return None
        return DataProto.from_dict({"ref_log_prob": log_probs.float()})

    # ------------------------------------------------------------------ training
    @register(dispatch_mode=Dispatch.mesh("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """ppo_epochs passes over this rank's rows in mini-batches; one optimizer step each."""
        s, engine = self.s, self.engine
        ppo_update.prepare_actor_batch(s, data)
        minis = ppo_update.mini_batches("update_actor", s, data, engine.dp_size)
        loss_fn = ppo_update.actor_loss_fn(s)
        t0 = time.perf_counter()
        means = ppo_update.MetricMeans()
        for mini in minis:
            step = engine.train_batch(mini, loss_fn, skip_rows=ppo_update.actor_skip_rows(s, mini))
            means.add("actor", ppo_update.actor_step_metrics(step, mini))
        self._weights_stale = True
        metrics = means.means()
        metrics["timing_s/update_actor_worker"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> bool:
        """The actor engine's sharded state, this rank's RNG streams (training and generation) and,
        from rank 0, the engine metadata the HF export reads (workers/checkpoint.py)."""
        from workers import checkpoint as ckpt

        ckpt.save_worker_checkpoint(self.engine, path, self.rank, self.world_size,
                                    self.rng if self.rollout is not None else None)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> bool:
        from workers import checkpoint as ckpt

        ckpt.load_worker_checkpoint(self.engine, path, self.rank, self.rng if self.rollout is not None else None)
        self._weights_stale = True  # the rollout still holds the initial weights
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str) -> bool:
        self.engine.save_hf(path)
        return True
