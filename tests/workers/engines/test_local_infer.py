"""Inference on one rank alone (workers/engines/local_infer.py) on 2 real gloo ranks.

The hybrid worker (actor + reference, FSDP replicated) and the critic worker are built on each
rank as the controller builds them, and called as plain methods. First the group calls (each rank
its half, collectives included); then rank 0 computes the whole batch with the ``*_local`` methods
while rank 1 sleeps and then runs a local call of its own on two rows (another number of
micro-batches under the token budget: any collective would hang or mismatch). Rank 0's outputs
equal the group calls' to 1e-6. A sharded FSDP engine refuses, and so does a Megatron TP = 2
layout by its coordinates; Megatron TP = PP = 1 runs alone like FSDP replicated.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import make_rl_batch

ROWS, P, R, VOCAB, TEMP = 8, 8, 8, 128, 0.7
KEYS = ("old_log_probs", "entropys", "ref_log_prob", "values", "megatron")


def _engine_config(**overrides):
    from workers.engines.config import EngineConfig

    # a token budget that splits the batch: the planner's cross-rank count is what local skips.
    # Batch order, so that the whole batch's micro-batches are the two halves' and the numbers
    # equal to 1e-6 (length order recuts them: equal to fp32 rounding of other widths only)
    base = dict(fsdp_size=1, micro_batch_size_per_gpu=2, infer_max_token_len_per_gpu=40, group_by_length=False,
                seed=0)
    return EngineConfig(**{**base, **overrides})


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "broadcast_object_list", "all_gather_object", "barrier", "send", "recv")


@contextmanager
def _counting_collectives():
    """Names of the torch.distributed collectives called in the body (each still runs)."""
    import torch.distributed as dist

    calls, saved = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _local_worker(rank, world, ckpt):
    import torch.distributed as dist

    from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
    from workers.critic import CriticSettings, CriticWorker
    from workers.engines.local_infer import local_inference_block, local_log_prob
    from workers.engines.megatron import MegatronEngine

    data = make_rl_batch(ROWS, P, R, VOCAB, seed=3)
    data.meta_info["temperature"] = TEMP
    half = data[rank * ROWS // 2:(rank + 1) * ROWS // 2]
    actor = ActorRolloutRefWorker(ActorRolloutRefSettings(model_path=ckpt, roles=("actor", "ref"),
                                                          actor=_engine_config(), temperature=TEMP))
    critic = CriticWorker(CriticSettings(model_path=ckpt, engine=_engine_config()))
    actor.init_model(), critic.init_model()
    megatron = MegatronEngine(_engine_config(strategy="megatron", fsdp_size=-1), ckpt, "actor")
    out = {"ok": (actor.local_inference_ok(), critic.local_inference_ok(), local_inference_block(megatron))}
    with _counting_collectives() as calls:  # the counter sees the group calls' collectives
        group = {**actor.compute_log_prob(half).batch, **actor.compute_ref_log_prob(half).batch,
                 **critic.compute_values(half).batch, "megatron": megatron.compute_log_prob(half, TEMP)[0]}
    out["group_collectives"] = calls
    out["group"] = {k: v.numpy() for k, v in group.items()}
    if rank == 0:
        with _counting_collectives() as calls:
            local = {**actor.compute_log_prob_local(data).batch, **actor.compute_ref_log_prob_local(data).batch,
                     **critic.compute_values_local(data).batch, "megatron": local_log_prob(megatron, data, TEMP)[0]}
        out["local"] = {k: v.numpy() for k, v in local.items()}
        out["collectives"] = calls
    else:
        time.sleep(1.0)  # rank 0 is well into its local calls, alone
        out["local_rank1"] = critic.compute_values_local(data[:2]).batch["values"].numpy()
    dist.barrier()
    sharded = ActorRolloutRefWorker(ActorRolloutRefSettings(model_path=ckpt, roles=("actor",),
                                                            actor=_engine_config(fsdp_size=-1)))
    sharded.init_model()
    out["sharded_ok"] = sharded.local_inference_ok()
    try:
        sharded.compute_log_prob_local(half)
    except ValueError as err:
        out["sharded_error"] = str(err)
    megatron.tp = 2  # the coordinates decide; a TP=2 engine needs its TP peer in every forward
    out["megatron_tp2"] = local_inference_block(megatron)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = make_tiny_checkpoint(str(tmp_path_factory.mktemp("local") / "m"), seed=0)
    return run_distributed(_local_worker, 2, ckpt, timeout_s=240)


@pytest.mark.slow
def test_local_calls_equal_the_group_calls(results):
    assert results[0]["ok"] == results[1]["ok"] == (True, True, None)
    assert results[0]["group_collectives"].count("all_reduce") >= 4  # micro-batch counts of the 4 calls
    assert results[0]["collectives"] == []
    local = results[0]["local"]
    for key in KEYS:
        group = torch.cat([torch.from_numpy(results[r]["group"][key]) for r in (0, 1)])
        torch.testing.assert_close(torch.from_numpy(local[key]), group, atol=1e-6, rtol=0, msg=key)
    torch.testing.assert_close(torch.from_numpy(results[1]["local_rank1"]),
                               torch.from_numpy(results[0]["local"]["values"][:2]), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_layouts_that_need_other_ranks_are_refused(results):
    for r in (0, 1):
        assert results[r]["sharded_ok"] is False
        assert "fsdp_size=1" in results[r]["sharded_error"]
        assert "tp=pp=1" in results[r]["megatron_tp2"]


def test_the_layout_decides_without_building_an_engine():
    from types import SimpleNamespace

    from workers.engines.local_infer import local_inference_block, local_values

    assert local_inference_block(SimpleNamespace(tp=1, pp=1)) is None
    assert "tp=pp=1" in local_inference_block(SimpleNamespace(tp=1, pp=2))
    assert "does not say" in local_inference_block(object())
    with pytest.raises(ValueError, match="compute_values: no local inference on this layout: Megatron TP=2"):
        local_values(SimpleNamespace(tp=2, pp=1), None)
