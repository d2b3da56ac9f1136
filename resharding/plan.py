"""The reshard plan: which piece of which HF tensor each rank needs for vLLM, and who sends it.

Pure data, computed identically on every rank from the two layouts and the Megatron parameter
table (docs/contracts.md "Megatron parameter layout"). Fused Megatron tensors are split back into
HF tensors here (qkv -> q/k/v with grouped-query sizes, fc1 -> gate/up), so that every
transfer piece is one interval of one HF tensor along one dimension.

What a generation rank needs is what vLLM's weight loaders read from the full-size tensor they
are given (vLLM 0.x ``linear.py`` / ``vocab_parallel_embedding.py``):
  * column-parallel q/gate/up (weight and bias): rows ``[g*n/tp_g, (g+1)*n/tp_g)``;
  * k/v: the same, except that with fewer KV heads than ``tp_g`` each head is replicated on
    ``tp_g / kv_heads`` consecutive ranks (rows of head ``g // replicas``);
  * row-parallel o_proj/down_proj: columns split the same way;
  * embed_tokens/lm_head: vLLM pads the vocabulary to a multiple of 64 *before* splitting it, so
    rank g reads rows ``[min(g*Vp/tp_g, V), min((g+1)*Vp/tp_g, V))`` with ``Vp`` the padded size
    (the last ranks may read fewer rows, or none);
  * everything else (norms): the whole tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from resharding.layout import GenLayout, TrainLayout, check_layouts

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class TrainParam:
    """How one Megatron parameter of one pipeline stage is sharded for training.

    Same attributes as ``workers.models.layout.ParamSpec``; any object with them is accepted.
    ``hf_names`` are the full HF names (global layer index); several names mean the tensor is the
    per-rank concatenation of their TP shards along ``split_dim`` (``[q_r; k_r; v_r]``,
    ``[gate_r; up_r]``). ``split_dim=None``: replicated on every TP rank of the stage.
    """

    name: str
    hf_names: tuple[str, ...]
    split_dim: int | None
    fused: object
    shape_per_rank: tuple[int, ...]


@dataclass(frozen=True)
class ModelDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelDims":
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(heads, getattr(cfg, "num_key_value_heads", None) or heads, head_dim,
                   cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor, where its training shards live, and how vLLM splits it."""

    hf_name: str
    shape: tuple[int, ...]
    stage: int
    train_name: str          # the Megatron parameter holding it on ranks of ``stage``
    split_dim: int | None    # training TP split dimension (None: replicated)
    train_offset: int        # where this tensor's per-rank shard starts inside the fused Megatron tensor
    gen_rule: str            # column | kv | row | vocab | replicated


@dataclass(frozen=True)
class Piece:
    """Interval ``[start, stop)`` along ``dim`` of tensor ``tensor`` (dim None: the whole tensor),
    sent from ``src`` to ``dst``; ``src_start`` is its start inside ``src``'s Megatron tensor."""

    tensor: int
    dst: int
    src: int
    dim: int | None
    start: int
    stop: int
    src_start: int


@dataclass
class ReshardPlan:
    train: TrainLayout
    gen: GenLayout
    tensors: list[HFTensor]
    pieces: list[Piece]
    needed: dict[tuple[int, int], tuple[int | None, int, int]] = field(default_factory=dict)

    def numel(self, piece: Piece) -> int:
        shape = list(self.tensors[piece.tensor].shape)
        if piece.dim is not None:
            shape[piece.dim] = piece.stop - piece.start
        return math.prod(shape)

    def elements(self, rank: int) -> dict[str, int]:
        """Elements this rank receives from peers, sends to peers, and copies locally."""
        out = {"received": 0, "sent": 0, "local": 0}
        for p in self.pieces:
            n = self.numel(p)
            if p.src == p.dst == rank:
                out["local"] += n
            elif p.dst == rank:
                out["received"] += n
            elif p.src == rank:
                out["sent"] += n
        return out

    def model_elements(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)


def _rows(hf_name: str, dims: ModelDims) -> int:
    """Full size along dim 0 of one part of a fused tensor."""
    if ".q_proj." in hf_name:
        return dims.num_heads * dims.head_dim
    if ".k_proj." in hf_name or ".v_proj." in hf_name:
        return dims.num_kv_heads * dims.head_dim
    if ".gate_proj." in hf_name or ".up_proj." in hf_name:
        return dims.intermediate
    raise ValueError(f"cannot un-fuse {hf_name!r}: only q/k/v_proj and gate/up_proj are fused")


def _gen_rule(hf_name: str, ndim: int) -> str:
    if "embed_tokens." in hf_name or hf_name.startswith("lm_head."):
        return "vocab"
    if ".k_proj." in hf_name or ".v_proj." in hf_name:
        return "kv"
    if any(k in hf_name for k in (".q_proj.", ".gate_proj.", ".up_proj.")):
        return "column"
    if (".o_proj." in hf_name or ".down_proj." in hf_name) and ndim == 2:
        return "row"
    return "replicated"


def hf_tensors(stage_params: Sequence[Sequence[object]], dims: ModelDims, tp: int) -> list[HFTensor]:
    """Un-fuse the Megatron table (one list of params per stage) into HF tensors with full shapes."""
    out: list[HFTensor] = []
    for stage, params in enumerate(stage_params):
        for p in params:
            local = tuple(p.shape_per_rank)
            names = tuple(p.hf_names)
            if p.split_dim is None:
                if len(names) != 1:
                    raise ValueError(f"{p.name}: a replicated parameter must map to one HF name, got {names}")
                out.append(HFTensor(names[0], local, stage, p.name, None, 0, _gen_rule(names[0], len(local))))
                continue
            d = p.split_dim
            if len(names) == 1:
                sizes = [local[d]]
            else:
                if d != 0:
                    raise ValueError(f"{p.name}: fused parameters must be split on dim 0, got {d}")
                sizes = [_rows(n, dims) // tp for n in names]
                if sum(sizes) != local[d]:
                    raise ValueError(f"{p.name}: per-rank rows {local[d]} != sum of {names} shards {sizes}; "
                                     f"the parameter table disagrees with the model config (heads/kv_heads/intermediate)")
            offset = 0
            for n, size in zip(names, sizes):
                shape = list(local)
                shape[d] = size * tp
                out.append(HFTensor(n, tuple(shape), stage, p.name, d, offset, _gen_rule(n, len(local))))
                offset += size
    seen = set()
    for t in out:
        if t.hf_name in seen:
            raise ValueError(f"HF tensor {t.hf_name} appears twice in the parameter table")
        seen.add(t.hf_name)
    return out


def gen_region(t: HFTensor, g: int, tp_g: int, dims: ModelDims,
               vocab_padding: int = VLLM_VOCAB_PADDING) -> tuple[int | None, int, int]:
    """The (dim, start, stop) vLLM's loader on generation-TP rank ``g`` reads from ``t``."""
    if t.gen_rule == "replicated":
        return (None, 0, 0)
    if t.gen_rule == "vocab":
        v = t.shape[0]
        per = -(-v // vocab_padding) * vocab_padding // tp_g
        return (0, min(g * per, v), min((g + 1) * per, v))
    if t.gen_rule == "kv" and dims.num_kv_heads < tp_g:
        head = g // (tp_g // dims.num_kv_heads)
        return (0, head * dims.head_dim, (head + 1) * dims.head_dim)
    dim = 1 if t.gen_rule == "row" else 0
    n = t.shape[dim] // tp_g
    return (dim, g * n, (g + 1) * n)


def check_generation_dims(dims: ModelDims, tp_g: int) -> None:
    if dims.num_heads % tp_g:
        raise ValueError(f"rollout tensor_model_parallel_size={tp_g} must divide num_attention_heads={dims.num_heads}")
    if dims.num_kv_heads % tp_g and tp_g % dims.num_kv_heads:
        raise ValueError(f"rollout tensor_model_parallel_size={tp_g} and num_key_value_heads={dims.num_kv_heads}: "
                         f"one must divide the other (vLLM's rule)")
    if dims.intermediate % tp_g:
        raise ValueError(f"rollout tensor_model_parallel_size={tp_g} must divide intermediate_size={dims.intermediate}")


def build_plan(train: TrainLayout, gen: GenLayout, stage_params: Sequence[Sequence[object]],
               dims: ModelDims, vocab_padding: int = VLLM_VOCAB_PADDING) -> ReshardPlan:
    """Plan every generation shard of every HF tensor, each element delivered exactly once.

    Source choice per piece: the receiving rank itself when it holds it (no move); otherwise, among
    the ranks holding that training shard, the one that has sent the fewest elements so far (the
    slowest sender bounds the transition), ties to the nearest rank.
    """
    check_layouts(train, gen)
    check_generation_dims(dims, gen.tp)
    if len(stage_params) != train.pp:
        raise ValueError(f"got parameter tables for {len(stage_params)} stages, the layout has pp={train.pp}")
    tensors = hf_tensors(stage_params, dims, train.tp)
    plan = ReshardPlan(train, gen, tensors, [])
    sent = [0] * train.world
    for ti, t in enumerate(tensors):
        for dst in range(train.world):
            region = gen_region(t, gen.tp_rank(dst, train), gen.tp, dims, vocab_padding)
            if region[0] is None and t.split_dim is not None:  # whole tensor, split in training
                region = (t.split_dim, 0, t.shape[t.split_dim])
            plan.needed[(ti, dst)] = region
            for tp_rank, start, stop, src_start in _split_by_training_shards(t, region, train.tp):
                if region[0] is not None and stop <= start:
                    continue
                holders = train.holders(t.stage, tp_rank)
                if dst in holders:
                    src = dst
                else:
                    src = min(holders, key=lambda h: (sent[h], abs(h - dst), h))
                piece = Piece(ti, dst, src, region[0], start, stop, src_start)
                if src != dst:
                    sent[src] += plan.numel(piece)
                plan.pieces.append(piece)
    return plan


def _split_by_training_shards(t: HFTensor, region, tp: int):
    """Yield (training tp rank or None, start, stop, start inside that rank's Megatron tensor)."""
    dim, start, stop = region
    if t.split_dim is None:
        if dim is not None:  # a slice of a replicated tensor: any TP rank has it
            yield None, start, stop, start
            return
        yield None, 0, 0, 0
        return
    if dim != t.split_dim:
        raise ValueError(f"{t.hf_name}: vLLM splits dim {dim} but training splits dim {t.split_dim}")
    n = t.shape[dim] // tp
    for r in range(tp):
        lo, hi = max(start, r * n), min(stop, (r + 1) * n)
        if lo < hi:
            yield r, lo, hi, t.train_offset + lo - r * n


def plan_from_param_specs(param_specs: Callable[..., Iterable[object]], hf_config, train: TrainLayout,
                          gen: GenLayout, vocab_padding: int = VLLM_VOCAB_PADDING) -> ReshardPlan:
    """Build the plan from ``workers.models.layout.param_specs`` (passed in: resharding never
    imports workers)."""
    stages = [list(param_specs(hf_config, train.tp, train.pp, s)) for s in range(train.pp)]
    return build_plan(train, gen, stages, ModelDims.from_hf_config(hf_config), vocab_padding)
