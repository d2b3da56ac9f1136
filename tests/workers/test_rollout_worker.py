"""The rollout pool's worker and the weight sync into it from a trainer pool (two worlds).

Slow case: a trainer group (roles ("actor",), FSDP, fp32), a Megatron trainer group (TP=1), a
rollout group (RolloutWorker, vLLM with load_format=dummy) and a hybrid group (actor+rollout) on
four disjoint 1-slot pools. Both FSDP actors make the same update; the trainer stages its weights,
the rollout loads them. Then vLLM's log-probs of its own samples equal the trainer's (which moved
away from the checkpoint: checked), the hybrid worker generates the same tokens (same seed, same
weights), and every row carries the loaded version. A Megatron trainer's weights sync the same
way. A trainer that dies takes its staged buckets with it: the next load fails in one clear line.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridflow.protocol import DataProto
from workers.rollout.base import RolloutConfig
from resharding.staging import StagedWeights, pack_buckets
from workers.rollout_worker import VERSION_KEY, RolloutWorker, RolloutWorkerSettings, row_versions, staged_tensors

TOL, STALE = 1e-4, 1e-2  # tests/resharding/test_reshard_logprobs.py's: vLLM vs the trainer, fp32
PROMPT_LEN, RESPONSE_LEN = 12, 10


def _rollout_config(**kw) -> RolloutConfig:
    return RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, n=2, max_num_seqs=8,
                         kv_cache_gib=0.125, seed=0, **kw)


def test_generation_before_any_weights_is_one_clear_error():
    worker = RolloutWorker(RolloutWorkerSettings(model_path="unused", rollout=_rollout_config(load_format="dummy")))
    prompts = DataProto.from_dict({"input_ids": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(RuntimeError, match="holds no weights to generate with .* call load_weights first"):
        worker.generate_sequences(prompts)


def test_a_rollout_pool_of_its_own_runs_vllm_only():
    with pytest.raises(ValueError, match="runs vLLM only"):
        RolloutWorker(RolloutWorkerSettings(model_path="unused", rollout=RolloutConfig(name="hf")))


def test_a_row_records_the_oldest_version_that_wrote_its_tokens():
    from workers.rollout.vllm_partial import TOKEN_VERSIONS

    plain = DataProto.from_dict({"responses": torch.zeros(2, 3, dtype=torch.long)})
    assert row_versions(plain, 5).tolist() == [5, 5]
    partial = DataProto.from_dict({TOKEN_VERSIONS: torch.tensor([[3, 3, 4, -1], [4, 4, -1, -1], [-1, -1, -1, -1]])})
    assert row_versions(partial, 4).tolist() == [3, 4, 4]


def _staged(buckets) -> StagedWeights:
    (header, _), = pack_buckets([("w", torch.zeros(4))], 1 << 20)
    return StagedWeights(version=7, buckets=tuple(buckets), headers=(header,) * len(buckets), total_bytes=16,
                         seconds=0.0)


@pytest.mark.slow
def test_a_bucket_that_never_arrives_times_out_in_one_line(ray_cluster):
    import time

    never = ray_cluster.remote(num_cpus=0)(lambda: time.sleep(60)).remote()
    with pytest.raises(TimeoutError, match="bucket 1/1 of version 7 did not arrive within 0.5s"):
        list(staged_tensors(_staged([never]), timeout_s=0.5))
    ray_cluster.cancel(never, force=True)


def test_a_bucket_whose_owner_died_is_one_clear_error(monkeypatch):
    """Across hosts Ray cannot fetch an object whose owner (the trainer rank that staged it) died.
    On one host it still serves its local copy, so Ray's answer is stood in for here."""
    import ray

    def owner_died(ref, timeout=None):
        raise ray.exceptions.OwnerDiedError("ab" * 14, None, "")

    monkeypatch.setattr(ray, "get", owner_died)
    with pytest.raises(RuntimeError, match="bucket 1/1 of version 7 is gone: the trainer rank that staged it died"):
        list(staged_tensors(_staged(["ref"]), timeout_s=1))


def _group(name: str, role: str, cls, settings):
    from hybridflow.controller import (RayClassWithInitArgs, RayWorkerGroup, ResourcePool,
                                       create_colocated_worker_cls)

    pool = ResourcePool([1], cpus_per_slot=1, name_prefix=name, ready_timeout_s=60)
    group = RayWorkerGroup(pool, create_colocated_worker_cls({role: RayClassWithInitArgs(cls, settings)}),
                           name_prefix=name, timeout_s=240)
    return group.spawn([role])[role], pool


def _update_batch(vocab: int) -> DataProto:
    from tests.workers.engines.fsdp_helpers import make_rl_batch

    data = make_rl_batch(8, PROMPT_LEN, RESPONSE_LEN, vocab, seed=3)
    data.meta_info["temperature"] = 1.0
    return data


def _max_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


@pytest.mark.slow
def test_weights_staged_by_a_trainer_pool_reach_a_separate_rollout_pool(ray_cluster, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    from hybridflow.controller import WorkerGroupError
    from hybridflow.tiny import make_tiny_checkpoint
    from tests.workers.rollout.common import load_hf, make_prompts, reference_log_probs
    from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
    from workers.engines.config import EngineConfig

    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), seed=0)  # qwen2, tied embeddings
    megatron = importlib.util.find_spec("megatron.core") is not None

    def actor(roles, strategy="fsdp"):
        return ActorRolloutRefSettings(
            model_path=ckpt, roles=roles, actor=EngineConfig(strategy=strategy, lr=1e-2, param_dtype="fp32"),
            rollout=_rollout_config(), ppo_mini_batch_size=8, seed=0)

    specs = {"trainer": ("actor", ActorRolloutRefWorker, actor(("actor",))),
             "rollout": ("rollout", RolloutWorker, RolloutWorkerSettings(
                 model_path=ckpt, rollout=_rollout_config(load_format="dummy"), seed=0)),
             "hybrid": ("actor_rollout", ActorRolloutRefWorker, actor(("actor", "rollout")))}
    if megatron:
        specs["megatron"] = ("actor", ActorRolloutRefWorker, actor(("actor",), "megatron"))
    groups, pools = {}, []
    try:
        for name, (role, cls, settings) in specs.items():
            groups[name], pool = _group(name, role, cls, settings)
            pools.append(pool)
        for f in [g.submit("init_model") for g in groups.values()]:  # the engines start at once
            f.get()
        trainer, rollout, hybrid = groups["trainer"], groups["rollout"], groups["hybrid"]

        update = _update_batch(load_hf(ckpt).config.vocab_size)
        steps = [groups[n].submit("update_actor", update) for n in ("trainer", "hybrid", "megatron") if n in groups]
        for f in steps:
            f.get()
        staged = trainer.stage_weights(version=1)
        assert staged[0].version == 1 and staged[0].total_bytes > 0
        load = rollout.load_weights(staged[0])[0]
        assert load["weight_sync/version"] == 1 and load["weight_sync/bytes"] == staged[0].total_bytes

        prompts = make_prompts(ckpt, prompt_len=PROMPT_LEN)
        out = rollout.generate_sequences(prompts)
        assert torch.equal(out.batch[VERSION_KEY], torch.ones(len(out), dtype=torch.int64))
        assert out.meta_info["metrics"]["timing_s/gen_worker"] > 0
        mask = out.batch["response_mask"]
        # (a) vLLM's log-probs of its samples are the trainer's, which are no longer the checkpoint's
        trained = trainer.compute_log_prob(out).batch["old_log_probs"]
        assert _max_gap(out.batch["rollout_log_probs"], trained, mask) < TOL
        assert _max_gap(reference_log_probs(load_hf(ckpt), out), trained, mask) > STALE
        # (b) the hybrid engine after the same update generates the same tokens
        same = hybrid.generate_sequences(prompts)
        assert torch.equal(same.batch["responses"], out.batch["responses"])
        assert _max_gap(same.batch["rollout_log_probs"], out.batch["rollout_log_probs"], mask) < TOL

        # a checkpoint holds the generation stream: after a resume (and the trainer's next sync) the
        # rollout samples what it would have sampled without the stop
        path = str(tmp_path / "rollout_state")
        rollout.save_checkpoint(path)
        uninterrupted = rollout.generate_sequences(prompts).batch["responses"]
        assert not torch.equal(uninterrupted, out.batch["responses"])  # sampling moves on between calls
        assert rollout.load_checkpoint(path) == [1]
        with pytest.raises(WorkerGroupError, match="holds no weights to generate with"):
            rollout.generate_sequences(prompts)
        rollout.load_weights(staged[0])
        assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], uninterrupted)

        if megatron:  # the Megatron layout's full tensors (a TP=1 plan over its world) sync alike
            loaded = rollout.load_weights(groups["megatron"].stage_weights(version=2)[0])[0]
            assert loaded["weight_sync/version"] == 2
            out = rollout.generate_sequences(prompts)
            assert int(out.batch[VERSION_KEY].unique()) == 2
            trained = groups["megatron"].compute_log_prob(out).batch["old_log_probs"]
            assert _max_gap(out.batch["rollout_log_probs"], trained, out.batch["response_mask"]) < TOL

    finally:
        for g in groups.values():
            g.shutdown()
        for pool in pools:
            pool.release()


@pytest.mark.slow
def test_two_trainer_ranks_sync_into_a_tp2_rollout(ray_cluster, tmp_path):
    """Both sides sharded: a 2-rank FSDP trainer (roles actor+ref: no rollout of its own) stages
    from rank 0 only; each rank of a TP=2 rollout reads every bucket and loads its shard, here
    through partial rollout's weight board."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
    from hybridflow.controller.weight_board import new_weight_board
    from workers.rollout.vllm_partial import TOKEN_VERSIONS, WEIGHT_SWITCHES
    from hybridflow.tiny import make_tiny_checkpoint
    from tests.workers.rollout.common import load_hf, make_prompts
    from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
    from workers.engines.config import EngineConfig

    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), seed=0)
    config = _rollout_config(tensor_model_parallel_size=2, load_format="dummy")
    pools = [ResourcePool([2], cpus_per_slot=1, name_prefix=n, ready_timeout_s=60) for n in ("trainer", "rollout")]
    trainer = RayWorkerGroup(pools[0], RayClassWithInitArgs(ActorRolloutRefWorker, ActorRolloutRefSettings(
        model_path=ckpt, roles=("actor", "ref"), actor=EngineConfig(lr=1e-2, param_dtype="fp32"), rollout=config,
        ppo_mini_batch_size=8, seed=0)), name_prefix="trainer", timeout_s=240)
    rollout = RayWorkerGroup(pools[1], RayClassWithInitArgs(RolloutWorker, RolloutWorkerSettings(
        model_path=ckpt, rollout=config, seed=0)), name_prefix="rollout", timeout_s=240)
    try:
        for f in [trainer.submit("init_model"), rollout.submit("init_model")]:
            f.get()
        rollout.load_weights(trainer.stage_weights(version=0)[0])
        trainer.update_actor(_update_batch(load_hf(ckpt).config.vocab_size))
        staged = trainer.stage_weights(version=4)
        assert staged[1] is None and staged[0].version == 4
        # partial rollout: weights posted on the board while a generation runs reach it (here before
        # its first engine step, so every token is the new version's); the first TP rank decides
        board = new_weight_board()
        ray_cluster.get(board.post.remote(staged[0]))
        prompts = make_prompts(ckpt, prompt_len=PROMPT_LEN, meta={"weight_board": board})
        out = rollout.generate_sequences(prompts)
        mask = out.batch["response_mask"]
        assert (out.batch[VERSION_KEY] == 4).all()
        assert torch.equal(out.batch[TOKEN_VERSIONS], torch.where(mask.bool(), 4, -1))
        assert out.meta_info["metrics"][WEIGHT_SWITCHES] == 1
        assert _max_gap(out.batch["rollout_log_probs"], trainer.compute_log_prob(out).batch["old_log_probs"],
                        mask) < TOL
        assert _max_gap(out.batch["rollout_log_probs"], trainer.compute_ref_log_prob(out).batch["ref_log_prob"],
                        mask) > STALE  # the reference still holds the checkpoint: the update moved the policy
        # the load the controller queued behind that generation finds the version already there
        assert [m["weight_sync/bytes"] for m in rollout.load_weights(staged[0])] == [0.0, 0.0]
        assert (rollout.generate_sequences(make_prompts(ckpt, prompt_len=PROMPT_LEN)).batch[VERSION_KEY] == 4).all()
    finally:
        trainer.shutdown()
        rollout.shutdown()
        for pool in pools:
            pool.release()
