"""The critic worker: a value model on a training engine (same backbone family as the actor plus
a scalar head), for GAE-based PPO."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.model_overrides import import_external_lib
from hybridflow.protocol import DataProto
from workers import ppo_update
from workers.actor_rollout_ref import build_engine
from workers.engines.config import EngineConfig


@dataclass
class CriticSettings:
    model_path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    ppo_mini_batch_size: int = 8  # rows per optimizer step over all dp ranks
    ppo_epochs: int = 1
    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    shuffle: bool = False
    seed: int = 0
    external_lib: str | None = None  # imported before the model is built (as the actor worker's)


class CriticWorker(Worker):
    def __init__(self, settings: CriticSettings):
        super().__init__()
        self.s = settings
        self.engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        import_external_lib(self.s.external_lib)
        self.init_distributed()
        self.engine = build_engine(self.s.engine, self.s.model_path, "critic")
        self.register_mesh("critic", self.engine.dp_rank, self.engine.dp_size, self.engine.is_collect)
        return True

    @register(dispatch_mode=Dispatch.mesh("critic"))
    def compute_values(self, data: DataProto) -> DataProto | None:
        values = self.engine.compute_values(data)
        return DataProto.from_dict({"values": values.float()}) if self.engine.is_collect else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_values_local(self, data: DataProto) -> DataProto:
        """compute_values of ``data`` on this rank alone, no collective (workers/engines/local_infer.py):
        a rank freed from generation runs it while the others still generate."""
        from workers.engines.local_infer import local_values

        return DataProto.from_dict({"values": local_values(self.engine, data).float()})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_inference_ok(self) -> bool:
        """Whether this layout lets compute_values_local run on one rank alone."""
        from workers.engines.local_infer import local_inference_block

        return local_inference_block(self.engine) is None

    @register(dispatch_mode=Dispatch.mesh("critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        loss_fn = ppo_update.critic_loss_fn(self.s)
        t0 = time.perf_counter()
        means = ppo_update.MetricMeans()
        for mini in ppo_update.mini_batches("update_critic", self.s, data, self.engine.dp_size):
            means.add("critic", self.engine.train_batch(mini, loss_fn))
        metrics = means.means()
        metrics["timing_s/update_critic_worker"] = time.perf_counter() - t0
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> bool:
        from workers import checkpoint as ckpt

        ckpt.save_worker_checkpoint(self.engine, path, self.rank, self.world_size)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str) -> bool:
        self.engine.save_hf(path)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> bool:
        from workers import checkpoint as ckpt

        ckpt.load_worker_checkpoint(self.engine, path, self.rank)
        return True
