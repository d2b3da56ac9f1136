"""Worker: the base class of every SPMD program that a WorkerGroup runs, one Ray actor per slot.

The group sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK in each actor's environment
before the constructor runs; ``init_distributed()`` joins the group's torch.distributed world
through the device module. A worker tells the controller how to split data for it by
registering meshes (``register_mesh``): the controller then needs no backend knowledge.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hybridflow import device
from hybridflow.controller import spans
from hybridflow.controller.dispatch import Dispatch, Execute, register
from hybridflow.ports import free_rendezvous_port


@dataclass(frozen=True)
class MeshRank:
    dp_rank: int
    dp_size: int
    is_collect: bool


class Worker:
    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._meshes: dict[str, MeshRank] = {}
        threads = os.environ.get("HYBRIDFLOW_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))

    # ------------------------------------------------------------ distributed
    def init_distributed(self, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or float(os.environ.get("HYBRIDFLOW_DIST_TIMEOUT_S", "600"))
        device.init_distributed(timeout_s=timeout_s)

    def register_mesh(self, name: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this rank's data-parallel coordinates under ``name`` (see Dispatch.mesh)."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"register_mesh({name!r}): dp_rank {dp_rank} not in [0, {dp_size})")
        self._meshes[name] = MeshRank(int(dp_rank), int(dp_size), bool(is_collect))

    # ------------------------------------------------------------ controller-side helpers
    def _hf_mesh(self, name: str):
        return self._meshes.get(name)

    def _hf_node_ip_and_free_port(self):
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_rendezvous_port()

    def _hf_set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])

    def _hf_pid(self) -> int:
        return os.getpid()

    def _hf_take_spans(self) -> list[tuple[str, float, float]]:
        """This process's stage spans since the last call (controller/spans.py); the first call starts
        the recording, so a run without a timeline never records."""
        spans.enable()
        return spans.take()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.ALL)
    def execute_fn(self, fn, *args, **kwargs):
        """Run an arbitrary picklable ``fn(worker, *args, **kwargs)`` on every rank (for tests/tools)."""
        return fn(self, *args, **kwargs)
