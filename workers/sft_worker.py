"""Supervised fine-tuning on a training engine: the response tokens' negative log-likelihood."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto
from workers.actor_rollout_ref import build_engine
from workers.engines.base import mini_batch_token_mean
from workers.engines.config import EngineConfig


def nll_loss_fn(outputs: dict, micro) -> tuple[torch.Tensor, dict[str, float]]:
    """Token mean over the whole mini-batch on all ranks (not a mean of micro-batch means)."""
    mask = micro.batch["response_mask"].to(outputs["log_probs"].dtype)
    loss = mini_batch_token_mean(-outputs["log_probs"], mask, micro)
    nll = float((-outputs["log_probs"].detach() * mask).sum() / mask.sum().clamp(min=1))
    return loss, {"train/nll": nll}


@dataclass
class SFTSettings:
    model_path: str
    engine: EngineConfig = field(default_factory=EngineConfig)


class SFTWorker(Worker):
    def __init__(self, settings: SFTSettings):
        super().__init__()
        self.s = settings
        self.engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        self.init_distributed()
        self.engine = build_engine(self.s.engine, self.s.model_path, "actor")
        self.register_mesh("actor", self.engine.dp_rank, self.engine.dp_size, self.engine.is_collect)
        return True

    @register(dispatch_mode=Dispatch.mesh("actor"))
    def train_step(self, data: DataProto) -> dict[str, float]:
        return self.engine.train_batch(data, nll_loss_fn)

    @register(dispatch_mode=Dispatch.mesh("actor"))
    def eval_nll(self, data: DataProto) -> DataProto | None:
        log_probs, _ = self.engine.compute_log_prob(data, 1.0)
        if not self.engine.is_collect:
            return None
        mask = data.batch["response_mask"].float()
        return DataProto.from_dict({"nll_sum": (-log_probs * mask).sum(-1), "tokens": mask.sum(-1)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> bool:
        """The engine's sharded state, this rank's RNG and (rank 0) the metadata the HF export
        reads: the same folder layout as the RL actor's (workers/checkpoint.py)."""
        from workers import checkpoint as ckpt

        ckpt.save_worker_checkpoint(self.engine, path, self.rank, self.world_size)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> bool:
        from workers import checkpoint as ckpt

        ckpt.load_worker_checkpoint(self.engine, path, self.rank)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str) -> bool:
        self.engine.save_hf(path)
        return True
