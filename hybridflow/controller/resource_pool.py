"""ResourcePool: device slots reserved as Ray placement groups (one per node, packed).

A slot is one GPU (with some CPUs) on a GPU cluster, or ``cpus_per_slot`` CPUs on a CPU machine,
where ``trainer.n_gpus_per_node`` then counts worker slots. Several worker groups may share a
pool (colocation: each slot hosts one actor of each group, or one colocated actor hosting several
roles); ``split`` carves disjoint sub-pools out of the same reservation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group


class ResourceError(RuntimeError):
    pass


@dataclass
class Slot:
    pg: PlacementGroup
    bundle_index: int
    node_rank: int


@dataclass
class ResourcePool:
    """``process_on_nodes[i]`` slots on node i. Placement groups are created on first use."""

    process_on_nodes: list[int]
    use_gpu: bool = False
    cpus_per_slot: float = 1.0
    max_colocate_count: int = 1
    name_prefix: str = "pool"
    ready_timeout_s: float = 60.0
    _slots: list[Slot] | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.process_on_nodes or any(n <= 0 for n in self.process_on_nodes):
            raise ValueError(f"ResourcePool: process_on_nodes must be positive counts, got {self.process_on_nodes}")

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus_per_slot}
        if self.use_gpu:
            b["GPU"] = 1
        return b

    def slots(self) -> list[Slot]:
        if self._slots is None:
            self._slots = self._reserve()
        return self._slots

    def _reserve(self) -> list[Slot]:
        need = {k: v * self.world_size for k, v in self.bundle().items()}
        have = ray.cluster_resources()
        for k, v in need.items():
            if have.get(k, 0) + 1e-9 < v:
                raise ResourceError(
                    f"ResourcePool {self.name_prefix!r}: needs {v:g} {k} for {self.world_size} slots but the Ray "
                    f"cluster has {have.get(k, 0):g}; lower trainer.n_gpus_per_node / nnodes or add resources")
        slots = []
        for node_rank, n in enumerate(self.process_on_nodes):
            pg = placement_group([self.bundle() for _ in range(n)], strategy="STRICT_PACK",
                                 name=f"{self.name_prefix}_node{node_rank}_{id(self):x}")
            try:
                ray.get(pg.ready(), timeout=self.ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ResourceError(
                    f"ResourcePool {self.name_prefix!r}: node {node_rank} could not host {n} slots of {self.bundle()} "
                    f"within {self.ready_timeout_s:g}s (is one node big enough?)") from None
            slots += [Slot(pg, i, node_rank) for i in range(n)]
        return slots

    def split(self, sizes: list[int]) -> list["ResourcePool"]:
        """Disjoint sub-pools over this pool's reservation (in slot order)."""
        if sum(sizes) != self.world_size:
            raise ValueError(f"ResourcePool.split: sizes {sizes} must sum to the pool's {self.world_size} slots")
        slots, out, start = self.slots(), [], 0
        for i, size in enumerate(sizes):
            sub = ResourcePool([size], self.use_gpu, self.cpus_per_slot, self.max_colocate_count,
                               f"{self.name_prefix}.{i}")
            sub._slots = slots[start:start + size]
            out.append(sub)
            start += size
        return out

    def release(self) -> None:
        for pg in {id(s.pg): s.pg for s in (self._slots or [])}.values():
            ray.util.remove_placement_group(pg)
        self._slots = None
