"""After a train -> generate switch, vLLM's log-probs equal the training engine's log-probs.

The training weights are first scaled away from the checkpoint vLLM started from, so a sync that
moved nothing (or the wrong shards) fails: the stale log-probs are checked to differ.

Two cases also override the model's config (``model.override_config``: a norm eps and a rope
theta far from the checkpoint's): before the scaling, the engine's (FSDP; Megatron at TP=1) and
vLLM's log-probs of vLLM's samples must equal those of an HF model built with the overridden
config, and differ from the checkpoint's own; the engine's ``save_hf`` must write that config.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed import run_distributed

TOL, STALE = 1e-4, 1e-2


def _have(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _prompts():
    from hybridflow.protocol import DataProto

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 0, 0, 20, 21, 22]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0], [3]])).long()
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"temperature": 1.0, "do_sample": True})


def _weights(engine, strategy, tp, pp, tp_g, world, stats):
    """The weight stream of this engine (what the hybrid worker wires up)."""
    from resharding.fsdp_stream import FSDPWeightStream
    from resharding.transfer import Resharder

    if strategy == "fsdp":  # default transport: shared buffers between these CPU ranks
        weights = FSDPWeightStream(bucket_bytes=1 << 16, stats=stats)
        return (lambda: weights.stream(engine.model.named_parameters())), stats
    from resharding.layout import GenLayout, TrainLayout
    from resharding.plan import plan_from_param_specs
    from workers.models.layout import param_specs

    plan = plan_from_param_specs(param_specs, engine.hf_config, TrainLayout(pp, tp, world // (tp * pp)),
                                 GenLayout(tp_g, world))
    resharder = Resharder(plan, bucket_bytes=1 << 16)
    local = dict(engine.model.named_parameters())
    return (lambda: resharder.stream(local)), resharder.stats


def _case(rank, world, ckpt, strategy, tp, pp, tp_g, overrides, hf_dir):
    import torch.distributed as dist

    from hybridflow.protocol import DataProto
    from resharding.switch import RNGStreams, generate_mode
    from resharding.transfer import TransferStats
    from workers.engines.config import EngineConfig
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    if strategy == "fsdp":
        from workers.engines.fsdp import FSDPEngine as Engine
    else:
        from workers.engines.megatron import MegatronEngine as Engine
    engine = Engine(EngineConfig(strategy=strategy, tp=tp, pp=pp, seed=0, override_config=overrides), ckpt, "actor")
    rollout = VLLMRollout(RolloutConfig(prompt_length=6, response_length=5, tensor_model_parallel_size=tp_g,
                                        max_num_seqs=4, seed=0, hf_overrides=overrides), ckpt)

    def engine_log_probs(batch):
        # Every rank scores every rank's samples: TP/PP ranks of one training group need equal data.
        parts = [None] * world
        dist.all_gather_object(parts, batch)
        lp, _ = engine.compute_log_prob(DataProto.concat(parts), temperature=1.0)
        return lp[rank * len(batch):(rank + 1) * len(batch)]

    def logprob_gap(batch):
        mask = batch.batch["response_mask"].bool()
        return float((engine_log_probs(batch) - batch.batch["rollout_log_probs"])[mask].abs().max())

    on_checkpoint = None
    if overrides:  # both still hold the checkpoint's weights: the parent compares them with HF
        batch = rollout.generate_sequences(_prompts())
        on_checkpoint = {k: v.numpy() for k, v in batch.batch.items()}
        on_checkpoint["engine_log_probs"] = engine_log_probs(batch).numpy()
        engine.save_hf(hf_dir)
    with torch.no_grad():  # training moved away from the checkpoint vLLM loaded
        for p in engine_parameters(engine, strategy):
            p.mul_(1.1)

    stale = logprob_gap(rollout.generate_sequences(_prompts()))
    weights, stats = _weights(engine, strategy, tp, pp, tp_g, world, TransferStats())
    with generate_mode(engine, rollout, weights, rng=RNGStreams(1), stats=stats) as metrics:
        fresh_batch = rollout.generate_sequences(_prompts())
    return stale, logprob_gap(fresh_batch), dict(metrics), on_checkpoint


def engine_parameters(engine, strategy):
    return list(engine.model.parameters())  # FSDP: DTensor shards; Megatron: this stage's TP shards


OVERRIDES = {"rms_norm_eps": 0.3, "rope_theta": 50.0}  # the checkpoint's: 1e-6 and 10000
CASES = [  # (strategy, tp, pp, tp_g, world, model.override_config, arch)
    ("megatron", 2, 1, 2, 2, {}, "qwen2"),
    ("megatron", 2, 1, 1, 2, {}, "qwen2"),
    ("megatron", 1, 2, 1, 2, OVERRIDES, "qwen2"),
    ("fsdp", 1, 1, 1, 2, OVERRIDES, "qwen2"),
    ("megatron", 2, 1, 1, 2, {}, "qwen3"),  # q/k norms (replicated) and a head_dim of its own
]


def _check_override_numerics(ckpt, results, hf_dir):
    """The engine's and vLLM's log-probs of vLLM's samples on the checkpoint's weights are those of
    HF's model built with the overridden config, not of the checkpoint's own; save_hf wrote it."""
    from transformers import AutoModelForCausalLM

    from hybridflow.model_overrides import load_hf_config
    from hybridflow.protocol import DataProto
    from tests.workers.engines.fsdp_helpers import hf_response_log_probs

    def hf_model(config):
        return AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()

    overridden, plain = hf_model(load_hf_config(ckpt, OVERRIDES)), hf_model(load_hf_config(ckpt))
    for rank, out in enumerate(results):
        batch = DataProto.from_dict({k: torch.from_numpy(v) for k, v in out.items()})
        with torch.no_grad():
            (want, mask), (unwanted, _) = (hf_response_log_probs(m, batch, 1.0) for m in (overridden, plain))
        for who, key in (("engine", "engine_log_probs"), ("vLLM", "rollout_log_probs")):
            got = batch.batch[key]
            assert (got - want)[mask].abs().max() < TOL, f"rank {rank}: {who} did not build the overridden model"
            assert (got - unwanted)[mask].abs().max() > STALE, f"rank {rank}: the override changed nothing"
    saved = load_hf_config(hf_dir)
    assert (saved.rms_norm_eps, saved.rope_parameters["rope_theta"]) == (0.3, 50.0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,tp,pp,tp_g,world,overrides,arch", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}" + ("-override_config" if c[5] else "")
                              + ("" if c[6] == "qwen2" else f"-{c[6]}") for c in CASES])
def test_vllm_logprobs_match_training_after_reshard(tmp_path, strategy, tp, pp, tp_g, world, overrides, arch):
    engine_module = "workers.engines.fsdp" if strategy == "fsdp" else "workers.engines.megatron"
    needed = [engine_module, "workers.rollout.vllm_rollout"] + (["workers.models.layout"] if strategy == "megatron" else [])
    if not _have(*needed):
        pytest.skip(f"needs {needed}")
    from hybridflow.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), arch=arch, tied=False, hidden=64, layers=2,
                                heads=2, kv_heads=2, intermediate=128, seed=0)
    hf_dir = str(tmp_path / "saved_hf")
    results = run_distributed(_case, world, ckpt, strategy, tp, pp, tp_g, overrides, hf_dir, timeout_s=540)
    if overrides:
        _check_override_numerics(ckpt, [r[3] for r in results], hf_dir)
    for rank, (stale, fresh, metrics, _) in enumerate(results):
        assert stale > STALE, f"rank {rank}: the perturbation did not change log-probs ({stale})"
        assert fresh < TOL, f"rank {rank}: vLLM log-probs differ from training by {fresh} after the reshard"
        assert metrics["timing_s/reshard"] > 0
        if tp == tp_g and pp == 1 and strategy == "megatron":
            assert metrics["reshard/bytes"] == 0  # every rank's vLLM shard is its own training shard
        else:
            assert metrics["reshard/bytes"] > 0
