"""Training (pp, tp, dp) and generation (tp_g, dp_g) layouts of the same ranks.

Training ranks follow megatron-core's order, ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``.

Generation groups differ from the HybridFlow paper on purpose. The paper (Sec. 5.4) makes the
generation TP groups *strided* inside a training TP group and the micro-DP groups consecutive, so
every rank's generation shard contains its own training shard. vLLM's ``external_launcher``
builds its TP groups from *consecutive* world ranks, and that is what the rollout runs, so
``GenLayout(order="consecutive")`` is the default. With it a rank's own training shard lies in
its generation shard only when ``tp_g`` is 1 or ``tp`` (or for the ranks where
``t // (tp/tp_g) == t % tp_g``); the plan then fetches the rest from peers, still moving every
element exactly once. ``order="strided"`` is the paper's grouping, for an engine that can take it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainLayout:
    """Megatron 3D layout: ``world = pp * tp * dp``."""

    pp: int
    tp: int
    dp: int

    def __post_init__(self):
        for name in ("pp", "tp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainLayout.{name}={getattr(self, name)} must be >= 1")

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, tp_rank, dp_rank) of a world rank, in megatron-core's order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a training world of {self.world}")
        return rank // (self.tp * self.dp), rank % self.tp, (rank // self.tp) % self.dp

    def rank(self, pp_rank: int, tp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def holders(self, pp_rank: int, tp_rank: int | None) -> list[int]:
        """Ranks that hold the training shard ``tp_rank`` of stage ``pp_rank`` (None: any tp rank,
        i.e. a parameter replicated across TP such as a norm)."""
        tps = range(self.tp) if tp_rank is None else [tp_rank]
        return sorted(self.rank(pp_rank, t, d) for t in tps for d in range(self.dp))

    def tp_group(self, rank: int) -> list[int]:
        p, _, d = self.coords(rank)
        return [self.rank(p, t, d) for t in range(self.tp)]


@dataclass(frozen=True)
class GenLayout:
    """vLLM layout: ``tp_g`` ranks per engine, ``dp_g = world / tp_g`` engines, no pipeline."""

    tp: int
    world: int
    order: Literal["consecutive", "strided"] = "consecutive"

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"rollout tensor_model_parallel_size={self.tp} must be >= 1")
        if self.world % self.tp:
            raise ValueError(f"rollout tensor_model_parallel_size={self.tp} does not divide the "
                             f"{self.world} ranks of the worker group; pick a divisor of {self.world}")
        if self.order not in ("consecutive", "strided"):
            raise ValueError(f"GenLayout.order={self.order!r}: use 'consecutive' (vLLM) or 'strided' (paper)")

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def tp_rank(self, rank: int, train: TrainLayout | None = None) -> int:
        """This rank's generation-TP index (which 1/tp_g slice of each split tensor it loads)."""
        if self.order == "consecutive":
            return rank % self.tp
        # strided (paper): inside a training TP group of size tp, generation TP rank t // (tp/tp_g)
        assert train is not None, "strided generation order needs the training layout"
        return train.coords(rank)[1] // (train.tp // self.tp)

    def dp_rank(self, rank: int, train: TrainLayout | None = None) -> int:
        """Index of this rank's generation engine (its generation-TP group), ordered by first rank."""
        firsts = sorted({self.tp_group(r, train)[0] for r in range(self.world)})
        return firsts.index(self.tp_group(rank, train)[0])

    def tp_group(self, rank: int, train: TrainLayout | None = None) -> list[int]:
        if self.order == "consecutive":
            start = rank - rank % self.tp
            return list(range(start, start + self.tp))
        assert train is not None, "strided generation order needs the training layout"
        micro = train.tp // self.tp
        base = rank - train.coords(rank)[1]  # first rank of this training TP group
        offset = train.coords(rank)[1] % micro
        return [base + offset + micro * i for i in range(self.tp)]


def check_layouts(train: TrainLayout, gen: GenLayout) -> None:
    """One-line errors for layouts the 3D-HybridEngine cannot pair."""
    if train.world != gen.world:
        raise ValueError(f"training world pp*tp*dp={train.pp}*{train.tp}*{train.dp}={train.world} "
                         f"!= generation world {gen.world}; actor and rollout must share the same ranks")
    if train.tp % gen.tp:
        raise ValueError(f"rollout tensor_model_parallel_size={gen.tp} must divide actor "
                         f"tensor_model_parallel_size={train.tp}; use one of "
                         f"{[d for d in range(1, train.tp + 1) if train.tp % d == 0]}")


def micro_dp_groups(train: TrainLayout, gen: GenLayout) -> list[list[int]]:
    """The paper's micro-DP groups: ``tp/tp_g`` consecutive ranks of one training TP group.

    With the paper's (strided) generation order, all-gathering the training shards inside a
    micro-DP group gives each member exactly its generation shard of a stage's TP-split tensors.
    """
    check_layouts(train, gen)
    micro = train.tp // gen.tp
    return [list(range(start, start + micro)) for start in range(0, train.world, micro)]


def pipeline_groups(train: TrainLayout) -> list[list[int]]:
    """Ranks with the same (tp_rank, dp_rank) across stages: they all-gather the other stages'
    layers, since generation runs the whole model on every rank (no pipeline)."""
    return [[train.rank(p, t, d) for p in range(train.pp)]
            for d in range(train.dp) for t in range(train.tp)]
