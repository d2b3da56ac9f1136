"""The reshard plan, on one process, for every (pp, tp, dp, tp_g) layout of up to 8 ranks."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from resharding.layout import GenLayout, TrainLayout, micro_dp_groups, pipeline_groups
from resharding.plan import build_plan, gen_region, HFTensor, plan_from_param_specs
from tests.resharding.megatron_table import (full_table, hf_config, megatron_shards, reference_weights,
                                             tiny_dims)


def layouts(max_world=8):
    for pp, tp, dp in itertools.product([1, 2, 4, 8], repeat=3):
        if pp * tp * dp > max_world:
            continue
        for tp_g in [d for d in range(1, tp + 1) if tp % d == 0]:
            yield pp, tp, dp, tp_g


def dims_for(tp):
    # Megatron needs tp | heads, kv_heads, vocab, intermediate; vocab 24 is padded to 64 by vLLM.
    return tiny_dims(heads=8, kv_heads=max(2, tp), head_dim=2, hidden=8, intermediate=16, vocab=24)


def make_plan(pp, tp, dp, tp_g, order="consecutive", tied=False):
    dims = dims_for(tp)
    train, gen = TrainLayout(pp, tp, dp), GenLayout(tp_g, pp * tp * dp, order)
    return build_plan(train, gen, full_table(dims, max(4, pp), tp, pp, tied=tied), dims)


def simulate(plan, full):
    """Run the plan on one process: each rank starts from NaN and copies pieces out of the
    source rank's Megatron shards; returns the per-rank full-size tensors."""
    shards = [megatron_shards(plan, full, r) for r in range(plan.train.world)]
    out = [{t.hf_name: torch.full(t.shape, float("nan")) for t in plan.tensors} for _ in shards]
    filled = [{t.hf_name: torch.zeros(t.shape, dtype=torch.int32) for t in plan.tensors} for _ in shards]
    for p in plan.pieces:
        t = plan.tensors[p.tensor]
        src = shards[p.src][t.train_name]  # KeyError = the plan names a source that lacks the stage
        if p.dim is None:
            piece, dst = src, out[p.dst][t.hf_name]
            cnt = filled[p.dst][t.hf_name]
        else:
            piece = src.narrow(p.dim, p.src_start, p.stop - p.start)
            dst = out[p.dst][t.hf_name].narrow(p.dim, p.start, p.stop - p.start)
            cnt = filled[p.dst][t.hf_name].narrow(p.dim, p.start, p.stop - p.start)
        dst.copy_(piece)
        cnt += 1
    return out, filled


def region_view(x, region):
    dim, start, stop = region
    return x if dim is None else x.narrow(dim, start, stop - start)


@pytest.mark.parametrize("order", ["consecutive", "strided"])
@pytest.mark.parametrize("pp,tp,dp,tp_g", list(layouts()))
def test_every_generation_element_delivered_once_and_correct(pp, tp, dp, tp_g, order):
    plan = make_plan(pp, tp, dp, tp_g, order)
    full = reference_weights(plan)
    out, filled = simulate(plan, full)
    for (ti, rank), region in plan.needed.items():
        name = plan.tensors[ti].hf_name
        assert torch.equal(region_view(out[rank][name], region), region_view(full[name], region)), (name, rank)
        counts = filled[rank][name]
        assert bool((region_view(counts, region) == 1).all()) and int(counts.sum()) == region_view(counts, region).numel(), \
            f"{name} on rank {rank}: elements delivered twice or outside vLLM's region"


@pytest.mark.parametrize("pp,tp,dp,tp_g", list(layouts()))
def test_bytes_moved_below_full_model_and_held_parts_never_move(pp, tp, dp, tp_g):
    plan = make_plan(pp, tp, dp, tp_g)
    model = plan.model_elements()
    for rank in range(plan.train.world):
        if tp > 1 or pp > 1:
            assert plan.elements(rank)["received"] < model
        else:
            assert plan.elements(rank)["received"] == 0  # pure data parallel: everything is local
    for p in plan.pieces:
        if p.src == p.dst:
            continue
        t = plan.tensors[p.tensor]
        dst_stage, dst_tp, _ = plan.train.coords(p.dst)
        if dst_stage != t.stage:
            continue
        assert t.split_dim is not None, f"{t.hf_name} is replicated on rank {p.dst} yet sent to it"
        n = t.shape[t.split_dim] // tp
        own = range(dst_tp * n, (dst_tp + 1) * n)
        assert p.stop <= own.start or p.start >= own.stop, f"{t.hf_name}: rank {p.dst} is sent rows it holds"


@pytest.mark.parametrize("pp,tp,dp,tp_g", [l for l in layouts() if l[1] > l[3]])
def test_paper_grouping_keeps_every_own_training_shard_local(pp, tp, dp, tp_g):
    """With strided generation groups (Sec. 5.4) each rank's generation shard contains its training
    shard (vocab tensors excepted: vLLM's padded vocab split does not align with Megatron's)."""
    plan = make_plan(pp, tp, dp, tp_g, "strided")
    for rank in range(plan.train.world):
        stage, tp_rank, _ = plan.train.coords(rank)
        local = sum(plan.numel(p) for p in plan.pieces
                    if p.src == p.dst == rank and plan.tensors[p.tensor].gen_rule != "vocab")
        own = sum(math.prod(t.shape) // (tp if t.split_dim is not None else 1) for t in plan.tensors
                  if t.stage == stage and t.gen_rule != "vocab")
        assert local == own
        # its micro-DP group is exactly the training-TP peers it exchanges split tensors with
        group = next(g for g in micro_dp_groups(plan.train, plan.gen) if rank in g)
        peers = {p.src for p in plan.pieces if p.dst == rank and plan.tensors[p.tensor].stage == stage
                 and plan.tensors[p.tensor].gen_rule in ("column", "row", "kv") and dp == 1}
        assert peers <= set(group)


def test_consecutive_grouping_loses_locality_only_where_it_must():
    """tp=4 -> tp_g=2 with vLLM's consecutive groups: ranks 1 and 2 hold none of their generation
    shard (they need training shards 2,3 and 0,1), ranks 0 and 3 hold half of it."""
    plan = make_plan(1, 4, 1, 2)
    layer = [i for i, t in enumerate(plan.tensors) if t.hf_name == "model.layers.0.mlp.down_proj.weight"][0]
    local = [sum(plan.numel(p) for p in plan.pieces if p.tensor == layer and p.src == p.dst == r) for r in range(4)]
    assert local == [32, 0, 0, 32]  # [h=8, I/tp=4]: half of the [8, 8] generation shard


def test_vocab_split_follows_vllm_padding():
    dims = tiny_dims(vocab=100)
    t = HFTensor("lm_head.weight", (100, 8), 0, "output_layer.weight", 0, 0, "vocab")
    # padded to 128 -> 64 rows per rank of tp_g=2; the last rank gets the 36 real rows left
    assert [gen_region(t, g, 2, dims) for g in range(2)] == [(0, 0, 64), (0, 64, 100)]
    assert [gen_region(t, g, 4, dims) for g in range(4)] == [(0, 0, 32), (0, 32, 64), (0, 64, 96), (0, 96, 100)]


def test_kv_heads_replicated_when_fewer_than_generation_tp():
    dims = tiny_dims(heads=4, kv_heads=2, head_dim=3)
    t = HFTensor("model.layers.0.self_attn.k_proj.weight", (6, 8), 0, "x", 0, 0, "kv")
    assert [gen_region(t, g, 4, dims) for g in range(4)] == [(0, 0, 3), (0, 0, 3), (0, 3, 6), (0, 3, 6)]


def test_tied_model_has_no_lm_head_and_pipeline_groups_cover_stages():
    plan = make_plan(2, 1, 2, 1, tied=True)
    assert "lm_head.weight" not in {t.hf_name for t in plan.tensors}
    assert pipeline_groups(plan.train) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("train,gen,match", [
    ((1, 2, 2), (4, 4), "must divide actor tensor_model_parallel_size=2"),
    ((1, 2, 2), (2, 2), "!= generation world 2"),
])
def test_bad_layouts_fail_with_one_clear_line(train, gen, match):
    dims = dims_for(train[1])
    with pytest.raises(ValueError, match=match) as err:
        build_plan(TrainLayout(*train), GenLayout(*gen), full_table(dims, 4, train[1], train[0]), dims)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        GenLayout(4, 6)


def test_agrees_with_workers_param_specs():
    layout = pytest.importorskip("workers.models.layout")
    dims = tiny_dims(heads=4, kv_heads=2, head_dim=32, hidden=128, intermediate=256, vocab=128)
    cfg = hf_config(dims, 4)
    for pp, tp in [(1, 2), (2, 2), (2, 1)]:
        train = TrainLayout(pp, tp, 1)
        ours = build_plan(train, GenLayout(1, train.world), full_table(dims, 4, tp, pp), dims)
        theirs = plan_from_param_specs(layout.param_specs, cfg, train, GenLayout(1, train.world))
        assert sorted(map(repr, ours.tensors)) == sorted(map(repr, theirs.tensors))
