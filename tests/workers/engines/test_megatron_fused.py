"""RLHFuse's fused actor-critic update (workers/engines/megatron_fused.py) on 2 real gloo ranks,
PP=2, tiny tied Qwen2 in fp32: a reversed critic equals a plain one, and the fused step equals the
actor's update followed by the critic's (weights and metrics, two optimizer steps), also with
micro-batches of different sizes per model, with TP=2 peers (4 ranks), and through the worker
method ``update_actor_and_critic``. One spawned job computes every number; the tests read them."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import make_rl_batch

WORLD, ROWS, P, R, VOCAB, TEMP = 2, 8, 8, 8, 128, 0.7
ATOL = 1e-6
CASES = {"same_micro": ({}, {}), "other_micro": ({"micro_batch_size_per_gpu": 3}, {"micro_batch_size_per_gpu": 2})}


def _cfg(**overrides):
    from workers.engines.config import EngineConfig

    base = dict(strategy="megatron", tp=1, pp=2, lr=1e-3, adam_eps=1e-5, grad_clip=1.0, micro_batch_size_per_gpu=2,
                seed=0)
    return EngineConfig(**{**base, **overrides})


def _batch(seed):
    data = make_rl_batch(ROWS, P, R, VOCAB, seed=seed)
    b, gen = data.batch, torch.Generator().manual_seed(seed + 100)
    b["old_log_probs"] = -3.0 * torch.rand(ROWS, R, generator=gen)
    b["values"] = b["returns"] + 0.3 * torch.randn(ROWS, R, generator=gen)
    b["advantages"][2] = 0.0  # an inert row: the actor's skip_rows leaves it out
    data.meta_info.update(temperature=TEMP, calculate_entropy=True)
    return data


def _weights(engine, rank):
    weights = {name: t.clone() for name, t in engine.export_hf_weights()}
    return weights if rank == 0 else None


def _losses():
    from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn, make_critic_loss_fn

    objective = ActorObjective()
    return objective, make_actor_loss_fn(objective), make_critic_loss_fn(0.5)


def _reversed_critic(rank, ckpt, workdir):
    from workers.engines.megatron import MegatronEngine

    _, _, critic_loss = _losses()
    data = _batch(1)
    out = {}
    for name, cfg in (("plain", _cfg()), ("reversed", _cfg(reverse_pipeline=True))):
        engine = MegatronEngine(cfg, ckpt, "critic")
        out[name] = dict(collect=engine.is_collect, stage=engine.stage, values=engine.compute_values(data),
                         step=engine.train_batch(data, critic_loss), weights=_weights(engine, rank))
        if name == "reversed":  # a reversed engine's checkpoint, loaded by a plain one
            engine.save_checkpoint(os.path.join(workdir, "reversed_ckpt"))
            plain = MegatronEngine(_cfg(), ckpt, "critic")
            plain.load_checkpoint(os.path.join(workdir, "reversed_ckpt"))
            out["loaded_weights"] = _weights(plain, rank)
    return out


def _fused_vs_sequential(rank, ckpt, actor_kw, critic_kw):
    from workers.engines.megatron import MegatronEngine
    from workers.engines.megatron_fused import fused_train_batch

    objective, actor_loss, critic_loss = _losses()
    seq = (MegatronEngine(_cfg(**actor_kw), ckpt, "actor"), MegatronEngine(_cfg(**critic_kw), ckpt, "critic"))
    fused = (MegatronEngine(_cfg(**actor_kw), ckpt, "actor"),
             MegatronEngine(_cfg(reverse_pipeline=True, **critic_kw), ckpt, "critic"))
    steps = []
    for seed in (2, 3):
        data = _batch(seed)
        skip = objective.inert_rows(data.batch)
        seq_metrics = (seq[0].train_batch(data, actor_loss, skip_rows=skip), seq[1].train_batch(data, critic_loss))
        fused_metrics = fused_train_batch(fused[0], data, actor_loss, fused[1], data, critic_loss, actor_skip_rows=skip)
        steps.append(dict(seq=seq_metrics, fused=fused_metrics, seq_weights=[_weights(e, rank) for e in seq],
                          fused_weights=[_weights(e, rank) for e in fused]))
    return steps


def _workers(rank, ckpt):
    """update_actor + update_critic vs update_actor_and_critic (actor: 2 mini-batches, critic: 1)."""
    from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
    from workers.critic import CriticSettings, CriticWorker

    def pair(fused: bool, reverse: bool = True):  # the hybrid worker has the fused update's mixin
        actor = ActorRolloutRefWorker(ActorRolloutRefSettings(model_path=ckpt, roles=("actor",), actor=_cfg(),
                                                              ppo_mini_batch_size=4, temperature=TEMP))
        critic = CriticWorker(CriticSettings(model_path=ckpt, engine=_cfg(reverse_pipeline=fused and reverse),
                                             ppo_mini_batch_size=8))
        actor.init_model()
        critic.init_model()
        actor._colocated_roles = critic._colocated_roles = {"actor": actor, "critic": critic}
        return actor, critic

    data = _batch(4)
    out = {}
    actor, critic = pair(False)
    out["seq"] = {**actor.update_actor(data[:]), **critic.update_critic(data[:])}
    out["seq_weights"] = [_weights(actor.engine, rank), _weights(critic.engine, rank)]
    actor, critic = pair(True)
    out["fused"] = actor.update_actor_and_critic(data[:])
    out["fused_weights"] = [_weights(actor.engine, rank), _weights(critic.engine, rank)]
    errors = []
    actor, _ = pair(True, reverse=False)
    for roles in (actor._colocated_roles, {}):
        actor._colocated_roles = roles
        try:
            actor.update_actor_and_critic(data[:])
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    return out


def _tp_scenario(rank, world, ckpt):
    return pickle.dumps(_fused_vs_sequential(rank, ckpt, {"tp": 2}, {"tp": 2}))


def _scenario(rank, world, ckpt, workdir):
    out = {"reversed": _reversed_critic(rank, ckpt, workdir)}
    for case, (actor_kw, critic_kw) in CASES.items():
        out[case] = _fused_vs_sequential(rank, ckpt, actor_kw, critic_kw)
    out["workers"] = _workers(rank, ckpt)
    return pickle.dumps(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return make_tiny_checkpoint(str(root / "model"), arch="qwen2", tied=True, layers=2, seed=0), root


@pytest.fixture(scope="module")
def results(checkpoint):
    ckpt, root = checkpoint
    return [pickle.loads(r) for r in run_distributed(_scenario, WORLD, ckpt, str(root / "work"), timeout_s=300)]


def _assert_same_weights(got, expected, label):
    assert got is not None and sorted(got) == sorted(expected), label
    for name, param in expected.items():
        assert torch.allclose(got[name], param, atol=ATOL, rtol=0), (label, name, (got[name] - param).abs().max())


def _assert_same_metrics(got, expected, label):
    assert sorted(got) == sorted(expected), label
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (label, key)


@pytest.mark.slow
def test_reversed_critic_equals_plain_critic(results):
    plain, rev = results[0]["reversed"]["plain"], results[0]["reversed"]["reversed"]
    # stage s on pipeline rank P-1-s: rank 0 holds the reversed critic's last stage and collects
    assert [r["reversed"]["reversed"]["stage"] for r in results] == [1, 0]
    assert [r["reversed"]["reversed"]["collect"] for r in results] == [True, False]
    assert [r["reversed"]["plain"]["collect"] for r in results] == [False, True]
    for r in results:  # outputs are broadcast to every rank
        got = r["reversed"]
        torch.testing.assert_close(got["reversed"]["values"], got["plain"]["values"], atol=ATOL, rtol=0)
    _assert_same_metrics(rev["step"], plain["step"], "critic step")
    _assert_same_weights(rev["weights"], plain["weights"], "reversed critic after one step")
    _assert_same_weights(results[0]["reversed"]["loaded_weights"], rev["weights"], "checkpoint reversed -> plain")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_equals_actor_then_critic(results, case):
    for rank, r in enumerate(results):
        for step, got in enumerate(r[case], start=1):
            for role, seq_m, fused_m in zip(("actor", "critic"), got["seq"], got["fused"]):
                _assert_same_metrics(fused_m, seq_m, f"{case} step {step} {role} rank {rank}")
            assert "skipped_rows_frac" in got["fused"][0] and "skipped_rows_frac" not in got["fused"][1]
    for step, got in enumerate(results[0][case], start=1):
        for role, seq_w, fused_w in zip(("actor", "critic"), got["seq_weights"], got["fused_weights"]):
            _assert_same_weights(fused_w, seq_w, f"{case} step {step} {role}")
    first, second = results[0][case]
    assert any(not torch.equal(first["fused_weights"][0][n], second["fused_weights"][0][n])
               for n in first["fused_weights"][0]), "the second step should move the actor"


@pytest.mark.slow
def test_fused_step_with_tensor_parallel_peers(checkpoint):
    """TP=2 x PP=2 on 4 ranks: a rank's TP peer must run the same model's forward at the same time
    (their all-reduces pair up), so the driver's choices are agreed over the TP group."""
    steps = [pickle.loads(r) for r in run_distributed(_tp_scenario, 4, checkpoint[0], timeout_s=300)]
    for rank, rank_steps in enumerate(steps):
        for step, got in enumerate(rank_steps, start=1):
            for role, seq_m, fused_m in zip(("actor", "critic"), got["seq"], got["fused"]):
                _assert_same_metrics(fused_m, seq_m, f"tp2 step {step} {role} rank {rank}")
    for step, got in enumerate(steps[0], start=1):
        for role, seq_w, fused_w in zip(("actor", "critic"), got["seq_weights"], got["fused_weights"]):
            _assert_same_weights(fused_w, seq_w, f"tp2 step {step} {role}")


@pytest.mark.slow
def test_worker_update_actor_and_critic(results):
    for r in results:
        res = r["workers"]
        seq = {k: v for k, v in res["seq"].items() if not k.startswith("timing_s/")}
        fused = dict(res["fused"])
        assert fused.pop("timing_s/update_fused_worker") > 0
        _assert_same_metrics(fused, seq, "worker metrics")
        assert any(k.startswith("actor/") for k in fused) and "critic/vf_loss" in fused
    res = results[0]["workers"]
    for seq_w, fused_w, role in zip(res["seq_weights"], res["fused_weights"], ("actor", "critic")):
        _assert_same_weights(fused_w, seq_w, f"worker {role}")
    not_reversed, no_critic = res["errors"]
    assert "reverse_pipeline=true" in not_reversed
    assert "needs the critic worker in the same process" in no_critic
