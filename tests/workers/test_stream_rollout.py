"""The workers' streaming methods (workers/stream_rollout.py) on 2 real gloo ranks, called rank by
rank as the controller calls each Ray actor (no Ray here: the methods are called as plain methods).

The rollout pool's worker (vLLM, TP=1: two generation-DP ranks): each rank streams its half of the
prompts greedily; after two slices rank 0 exports its unfinished samples and rank 1 adopts them,
rank 1 after its own session ended (the adopt opens a new one). The rows of both ranks, by
row_index, equal both ranks' generate_sequences, and each row carries the weight version;
load_weights is refused while a session is open. The hybrid worker (FSDP actor + vLLM loaded with
dummy weights): the stream syncs the actor's weights on entering generation (once, the timeline
shows weight_sync apart) and its rows equal generate_sequences' after it; the stream's calls record
as stage ``gen``. A TP=2 engine (both ranks step it in lockstep) exports one sample and takes it
back into its open session (a partial export: both ranks must pick the same one), then moves its
tail into a new session of its own and still returns generate_sequences' rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from tests.distributed import run_distributed
from tests.workers.rollout.common import PROMPT_LEN, RESPONSE_LEN, make_prompts

TEXTS = ["12+3=", "hello world", "a", "What is 7*8?", "xyz", "9-4=", "hi", "the cat sat"]
META = dict(do_sample=False, stop_token_ids=list(range(3, 23)))


def _share(path: str, rank: int) -> DataProto:
    prompts = make_prompts(path, texts=TEXTS, meta=dict(META))
    prompts.batch["row_index"] = torch.arange(len(TEXTS), dtype=torch.int64)
    half = len(TEXTS) // 2
    return prompts[rank * half:(rank + 1) * half]


def _np(data: DataProto) -> dict:
    return {k: v.numpy() for k, v in data.batch.items()}


def _drain(worker, max_steps: int, calls: int | None = None) -> tuple[list, dict]:
    rows, last = [], {}
    while not last.get("done") and (calls is None or calls > 0):
        last = worker.stream_step(max_steps)
        assert last["steps"] <= max_steps and isinstance(last["seconds"], float)
        # a TP=1 engine's rank is its collect rank: it reports each unfinished sample's progress
        # (row, tokens so far, max_tokens), which sample reallocation's estimate reads
        progress = last["progress"]
        if worker.rollout.is_collect:
            assert len(progress) == last["unfinished"], (progress, last["unfinished"])
            assert sum(tokens == 0 for _, tokens, _ in progress) == last["unstarted"]
            assert all(0 <= tokens <= cap == RESPONSE_LEN for _, tokens, cap in progress), progress
        else:
            assert progress is None
        if last["rows"] is not None:
            rows.append(_np(last["rows"]))
        calls = None if calls is None else calls - 1
    return rows, last


def _stream_worker(rank, world, path):
    import torch.distributed as dist

    from hybridflow.controller import spans
    from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
    from workers.engines.config import EngineConfig
    from workers.rollout.base import RolloutConfig
    from workers.rollout_worker import RolloutWorker, RolloutWorkerSettings

    def config(**kw):
        return RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.125, seed=0, **kw)

    out = {}
    pool = RolloutWorker(RolloutWorkerSettings(model_path=path, rollout=config()))
    pool.init_model()
    share = _share(path, rank)
    out["queued"] = pool.stream_start(share)
    rows, _ = _drain(pool, 2, calls=2)
    try:
        pool.load_weights(None)
    except RuntimeError as err:
        out["load_refused"] = str(err)
    if rank == 1:  # its own session ends first: the adopt below opens a new one
        own, out["own_done"] = _drain(pool, 3)
        rows += own
    partials = [pool.stream_export() if rank == 0 else None]
    dist.broadcast_object_list(partials, src=0)
    out["moved"] = [(p.row_index, len(p.token_ids)) for p in partials[0]]
    if rank == 0:
        out["exporter_step"] = pool.stream_step(3)
        out["exporter_metrics"] = pool.stream_metrics()
    else:
        out["adopted"] = pool.stream_adopt(partials[0])
    more, last = _drain(pool, 3)
    out["pool_rows"], out["pool_done"] = rows + more, last
    out["pool_reference"] = _np(pool.generate_sequences(_share(path, rank)))

    spans.enable()
    hybrid = ActorRolloutRefWorker(ActorRolloutRefSettings(
        model_path=path, roles=("actor", "rollout"), actor=EngineConfig(fsdp_size=1, seed=0),
        rollout=config(load_format="dummy")))
    hybrid.init_model()
    spans.take()
    hybrid.stream_start(_share(path, rank))
    out["hybrid_rows"], out["hybrid_done"] = _drain(hybrid, 4)
    out["spans"] = [name for name, _, _ in spans.take()]
    out["hybrid_reference"] = _np(hybrid.generate_sequences(_share(path, rank)))
    return out


def _tp2_worker(rank, world, path):
    """One TP=2 engine over both ranks: the same calls on both, a self-move (export, then adopt
    into a new session) in the middle; the collect rank's rows equal generate_sequences'."""
    import torch.distributed as dist

    from workers.rollout.base import RolloutConfig
    from workers.rollout_worker import RolloutWorker, RolloutWorkerSettings

    worker = RolloutWorker(RolloutWorkerSettings(model_path=path, rollout=RolloutConfig(
        prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.125, seed=0,
        tensor_model_parallel_size=2)))
    worker.init_model()
    prompts = _share(path, 0)
    prompts = DataProto.concat([prompts, _share(path, 1)])
    worker.stream_start(prompts)
    rows, _ = _drain(worker, 2, calls=1)
    # sample reallocation's partial export: both ranks must abort the same sample, or the engine's
    # two halves step different batches
    part = [worker.stream_export(1)]
    dist.broadcast_object_list(part, src=0)
    worker.stream_adopt(part[0])  # into the session that is still open
    more, _ = _drain(worker, 1, calls=1)
    rows += more
    exported = worker.stream_export()
    partials = [exported]
    dist.broadcast_object_list(partials, src=0)  # every rank of the TP group adopts the same list
    worker.stream_adopt(partials[0])
    more, last = _drain(worker, 3)
    return {"rows": rows + more, "exported": exported, "moved": len(partials[0]), "done": last, "partial": len(part[0]),
            "reference": _np(worker.generate_sequences(prompts))}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from hybridflow.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("stream_workers") / "m"), seed=0)
    return run_distributed(_stream_worker, 2, path, timeout_s=300)


def _joined(parts: list[dict]) -> dict:
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(out["row_index"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def _assert_rows_equal(rows: list[dict], references: list[dict]):
    got, want = _joined(rows), {k: np.concatenate([r[k] for r in references]) for k in references[0]}
    np.testing.assert_array_equal(got.pop("row_index"), np.arange(len(TEXTS)))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        tol = 1e-5 if key == "rollout_log_probs" else 0
        np.testing.assert_allclose(got[key], value, atol=tol, rtol=0, err_msg=key)


@pytest.mark.slow
def test_rollout_pool_streams_and_moves_its_tail(results):
    assert results[0]["queued"] == results[1]["queued"] == len(TEXTS) // 2
    assert "stream session is open" in results[0]["load_refused"]
    moved = results[0]["moved"]
    assert moved and moved == results[1]["moved"] and results[1]["adopted"] == len(moved)
    assert results[0]["exporter_step"]["done"] and results[0]["exporter_step"]["rows"] is None
    assert results[0]["exporter_metrics"]["rollout/stream_exported"] == len(moved)
    assert results[1]["own_done"]["done"]  # rank 1 adopted after its own generation ended
    done = results[1]["pool_done"]
    assert done["done"] and done["unfinished"] == 0 and done["metrics"]["rollout/stream_adopted"] == len(moved)
    rows = results[0]["pool_rows"] + results[1]["pool_rows"]
    assert all((r["rollout_weight_version"] == 0).all() for r in rows)
    _assert_rows_equal(rows, [results[r]["pool_reference"] for r in (0, 1)])


@pytest.mark.slow
def test_hybrid_worker_streams_after_syncing_its_weights(results):
    for r in (0, 1):
        done = results[r]["hybrid_done"]
        assert done["done"] and "timing_s/reshard" in done["metrics"] and "timing_s/gen_worker" in done["metrics"]
        assert "gen" in results[r]["spans"] and "weight_sync" in results[r]["spans"]
        assert not {"stream_start", "stream_step"} & set(results[r]["spans"])
    _assert_rows_equal(results[0]["hybrid_rows"] + results[1]["hybrid_rows"],
                       [results[r]["hybrid_reference"] for r in (0, 1)])


@pytest.mark.slow
def test_a_tp2_engine_streams_in_lockstep(tmp_path_factory):
    from hybridflow.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("stream_tp2") / "m"), seed=0)
    first, second = run_distributed(_tp2_worker, 2, path, timeout_s=300)
    assert second["exported"] is None and second["rows"] == [] and first["moved"] > 0 and first["partial"] == 1
    assert first["done"]["unfinished"] == second["done"]["unfinished"] == 0
    _assert_rows_equal(first["rows"], [first["reference"]])
