"""The rank side of the FSDP engine tests (``test_fsdp_engine.py``): each scenario builds engines
on its rank of a spawned gloo world and returns the numbers the tests compare with single-process
HF references. ``all_scenarios`` runs them all in one job, so process start-up is paid once."""
from __future__ import annotations

import os
import pickle

import torch

from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch, make_rl_batch, policy_gradient_loss, value_loss

WORLD, ROWS, P, R = 2, 8, 8, 8
TEMP, LR, WARMUP, CLIP = 0.7, 1e-3, 2, 1.0
# Adam's first update is lr * g / (|g| + eps): for |g| near eps it amplifies fp32 rounding in g by
# ~lr/eps. A larger eps than the default 1e-8 keeps the comparison of updated weights well
# conditioned (both sides use it); everything else about the step is the textbook AdamW.
ADAM_EPS = 1e-5
CRITIC_LR = 1e-3
VOCAB = 128


def engine_config(**overrides):
    from workers.engines.config import EngineConfig

    base = dict(lr=LR, adam_eps=ADAM_EPS, warmup_steps=WARMUP, lr_schedule="constant", grad_clip=CLIP, weight_decay=0.01,
                micro_batch_size_per_gpu=2, seed=0)
    return EngineConfig(**{**base, **overrides})


def rank_share(data, rank, world):
    n = len(data) // world
    return data[rank * n:(rank + 1) * n]


def full_weights(engine, rank):
    weights = {name: t.clone() for name, t in engine.export_hf_weights()}
    return weights if rank == 0 else None


def _actor_scenario(rank, world, ckpt, workdir, with_precision_variants, **layout):
    from workers.engines.fsdp import FSDPEngine

    def config(**overrides):  # every engine of the scenario in the same parameter layout
        return engine_config(**layout, **overrides)

    first = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    first.meta_info["temperature"] = TEMP
    second = make_rl_batch(ROWS, P, R, VOCAB, seed=2)
    second.meta_info["temperature"] = TEMP
    mine, mine2 = rank_share(first, rank, world), rank_share(second, rank, world)
    out = {}

    engine = FSDPEngine(config(), ckpt, "actor")
    assert (engine.dp_rank, engine.dp_size, engine.is_collect) == (rank, world, True)
    out["log_probs"], out["entropy"] = engine.compute_log_prob(mine, TEMP, calculate_entropy=True)
    packed = FSDPEngine(config(use_remove_padding=True), ckpt, "ref")
    out["packed_log_probs"], _ = packed.compute_log_prob(mine, TEMP)
    del packed

    out["step1"] = engine.train_batch(mine, policy_gradient_loss)
    out["weights1"] = full_weights(engine, rank)
    engine.save_checkpoint(os.path.join(workdir, "ckpt"))
    engine.save_hf(os.path.join(workdir, "hf"))
    out["log_probs_after"], _ = engine.compute_log_prob(mine, TEMP)
    out["step2"] = engine.train_batch(mine2, policy_gradient_loss)
    out["weights2"] = full_weights(engine, rank)
    out["versions"] = [engine.weights_version]  # two optimizer steps
    del engine

    resumed = FSDPEngine(config(), ckpt, "actor")
    resumed.load_checkpoint(os.path.join(workdir, "ckpt"))
    out["versions"].append(resumed.weights_version)  # a load changes the weights too
    out["step2_resumed"] = resumed.train_batch(mine2, policy_gradient_loss)
    out["weights2_resumed"] = full_weights(resumed, rank)
    del resumed

    if with_precision_variants:
        recompute = FSDPEngine(config(gradient_checkpointing=True), ckpt, "actor")
        out["step1_checkpointed"] = recompute.train_batch(mine, policy_gradient_loss)
        del recompute
        bf16 = FSDPEngine(config(param_dtype="bf16"), ckpt, "actor")
        out["log_probs_bf16"], _ = bf16.compute_log_prob(mine, TEMP)
        out["step1_bf16"] = bf16.train_batch(mine, policy_gradient_loss)
        del bf16
    return out


def _critic_scenario(rank, world, ckpt):
    from workers.engines.fsdp import FSDPEngine

    data = rank_share(make_rl_batch(ROWS, P, R, VOCAB, seed=3), rank, world)
    engine = FSDPEngine(engine_config(lr=CRITIC_LR, warmup_steps=0), ckpt, "critic")
    out = {"values": engine.compute_values(data)}
    out["losses"] = [engine.train_batch(data, value_loss)["vf_loss"] for _ in range(3)]
    out["values_after"] = engine.compute_values(data)
    return out


def _skip_scenario(rank, world, ckpt, **layout):
    """The real actor objective, three ways: every row computed (micro-batches of 2), zero-
    advantage rows skipped, and micro-batches of 1. Step 1 skips 3 of rank 0's 4 rows (so rank 0
    pads to rank 1's 4); step 2 has no advantage anywhere (nothing is computed at all).

    Before step 2 the skipping engine generates with its own module (``rollout.name=hf``), which
    goes around the engine: the step must still see sharded parameters and update the weights the
    module computes with (log-probs after step 2)."""
    from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn
    from torch.distributed.tensor import DTensor
    from workers.engines.fsdp import FSDPEngine
    from workers.rollout.base import RolloutConfig
    from workers.rollout.hf_rollout import HFRollout

    loss_fn, objective = make_actor_loss_fn(ActorObjective()), ActorObjective()
    first = make_rl_batch(ROWS, P, R, VOCAB, seed=4)
    first.batch["advantages"][1:4] = 0.0
    second = make_rl_batch(ROWS, P, R, VOCAB, seed=5)
    second.batch["advantages"][:] = 0.0
    out = {}
    for name, micro, skip in (("full", 2, False), ("skip", 2, True), ("micro1", 1, False)):
        engine = FSDPEngine(engine_config(micro_batch_size_per_gpu=micro, **layout), ckpt, "actor")
        for step, batch in enumerate((first, second), start=1):
            mine = rank_share(batch, rank, world)
            mine.meta_info.update(temperature=TEMP, calculate_entropy=True)
            if skip and step == 2:
                rollout = HFRollout(engine.model, RolloutConfig(name="hf", prompt_length=P, response_length=2),
                                    sync_ranks=True)
                rollout.generate_sequences(_prompts_of(mine))
                out["sharded_after_generate"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
            metrics = engine.train_batch(mine, loss_fn, skip_rows=objective.inert_rows(mine.batch) if skip else None)
            out[f"{name}_metrics{step}"] = metrics
            out[f"{name}_weights{step}"] = full_weights(engine, rank)
        out[f"{name}_log_probs_after"] = engine.compute_log_prob(mine, TEMP)[0]
    return out


def _prompts_of(data):
    """The prompt half of an RL batch, as a rollout receives it."""
    from hybridflow.protocol import DataProto

    b = data.batch
    return DataProto.from_dict({"input_ids": b["prompts"], "attention_mask": b["attention_mask"][:, :P],
                                "position_ids": b["position_ids"][:, :P]})


def _cross_layout_scenario(rank, world, ckpt, workdir):
    """A checkpoint saved in one parameter layout resumes in the other (DCP re-shards on load)."""
    from workers.engines.fsdp import FSDPEngine

    first, second = (rank_share(make_rl_batch(ROWS, P, R, VOCAB, seed=s), rank, world) for s in (6, 7))
    out = {}
    for saved, loaded in ((1, -1), (-1, 1)):
        engine = FSDPEngine(engine_config(fsdp_size=saved), ckpt, "actor")
        engine.train_batch(first, policy_gradient_loss)
        path = os.path.join(workdir, f"saved_{saved}")
        engine.save_checkpoint(path)
        reference = engine.train_batch(second, policy_gradient_loss)
        resumed = FSDPEngine(engine_config(fsdp_size=loaded), ckpt, "actor")
        resumed.load_checkpoint(path)
        out[(saved, loaded)] = (reference, resumed.train_batch(second, policy_gradient_loss),
                                full_weights(engine, rank), full_weights(resumed, rank))
    return out


def _prefix_scenario(rank, world, ckpt, **layout):
    """GRPO-shaped batches (4 samples per prompt) with and without one forward per distinct prompt:
    log-probs, a training step and the log-probs after it."""
    from workers.engines import prefix_sharing
    from workers.engines.fsdp import FSDPEngine

    calls = []
    shared_forward = prefix_sharing.shared_prefix_logits
    prefix_sharing.shared_prefix_logits = lambda *a, **k: calls.append(1) or shared_forward(*a, **k)
    first, second = (rank_share(make_grouped_rl_batch(ROWS // 4, 4, P, R, VOCAB, seed=s), rank, world) for s in (8, 9))
    out = {}
    for share in (False, True):
        calls.clear()
        engine = FSDPEngine(engine_config(share_prompt_prefix=share, **layout), ckpt, "actor")
        before = engine.compute_log_prob(first, TEMP)[0]
        metrics = engine.train_batch(first, policy_gradient_loss)
        out[share] = (before, metrics, engine.compute_log_prob(second, TEMP)[0], full_weights(engine, rank),
                      len(calls))
    prefix_sharing.shared_prefix_logits = shared_forward
    return out


def _prefetch_scenario(rank, world, ckpt):
    """Sharded, shared prompts (two model calls per micro-batch), gradient accumulation over two
    micro-batches: the same log-probs, step and weights with and without the one-layer-ahead
    parameter gathers; and whether the prefetch was really set up."""
    from workers.engines.fsdp import FSDPEngine

    first, second = (rank_share(make_grouped_rl_batch(ROWS // 4, 4, P, R, VOCAB, seed=s), rank, world) for s in (10, 11))
    out = {}
    for prefetch in (False, True):
        engine = FSDPEngine(engine_config(forward_prefetch=prefetch), ckpt, "actor")
        layers = list(engine.model.model.layers)
        configured = [bool(layer._get_fsdp_state()._states_to_forward_prefetch) for layer in layers[:-1]]
        before = engine.compute_log_prob(first, TEMP)[0]
        metrics = engine.train_batch(first, policy_gradient_loss)
        metrics2 = engine.train_batch(second, policy_gradient_loss)
        out[prefetch] = (before, metrics, metrics2, engine.compute_log_prob(second, TEMP)[0],
                         full_weights(engine, rank), configured)
    return out


def _gathered_scenario(rank, world, ckpt):
    """Sharded, gradient accumulation over two micro-batches, with and without
    reshard_after_forward: the log-probs, steps and weights, and whether every call left the
    parameters sharded (a DTensor each) behind it."""
    from torch.distributed.tensor import DTensor

    from workers.engines.fsdp import FSDPEngine

    first, second = (rank_share(make_grouped_rl_batch(ROWS // 4, 4, P, R, VOCAB, seed=s), rank, world) for s in (12, 13))
    out = {}
    for reshard in (True, False):
        engine = FSDPEngine(engine_config(reshard_after_forward=reshard), ckpt, "actor")
        sharded = []
        before = engine.compute_log_prob(first, TEMP)[0]
        sharded.append(all(isinstance(p, DTensor) for p in engine.model.parameters()))
        metrics = engine.train_batch(first, policy_gradient_loss)
        sharded.append(all(isinstance(p, DTensor) for p in engine.model.parameters()))
        metrics2 = engine.train_batch(second, policy_gradient_loss)
        out[reshard] = (before, metrics, metrics2, engine.compute_log_prob(second, TEMP)[0],
                        full_weights(engine, rank), sharded)
    return out


def _token_budget_scenario(rank, world, ckpt):
    """use_dynamic_bsz: micro-batches by a token budget (a different number of rows each, counts
    evened out across the ranks) give the log-probs and the step of fixed 2-row micro-batches."""
    from workers.engines.fsdp import FSDPEngine
    from workers.engines.token_budget import token_budget_micro_batches

    first, second = (rank_share(make_grouped_rl_batch(ROWS // 2, 2, P, R, VOCAB, seed=s), rank, world) for s in (14, 15))
    budget = 3 * (P + R) // 2  # one or two rows per micro-batch, depending on their spans
    out = {"micro_rows": [len(m) for m in token_budget_micro_batches(first, budget, device=torch.device("cpu"))]}
    for name, kwargs in (("fixed", {}), ("budget", dict(max_token_len_per_gpu=budget, infer_max_token_len_per_gpu=budget))):
        engine = FSDPEngine(engine_config(micro_batch_size_per_gpu=2, **kwargs), ckpt, "actor")
        before = engine.compute_log_prob(first, TEMP)[0]
        metrics = engine.train_batch(first, policy_gradient_loss)
        out[name] = (before, metrics, engine.compute_log_prob(second, TEMP)[0], full_weights(engine, rank))
    return out


def _gradient_reduction_scenario(rank, world, ckpt):
    """The replicated layout's gradient all-reduce on gloo (DDP's own, overlapped with backward)
    and through shared memory after backward (the default where vLLM's CPU kernels are): two
    steps of two accumulated micro-batches each, every number compared; and which path each took."""
    from workers.engines.fsdp import FSDPEngine

    first, second = (rank_share(make_grouped_rl_batch(ROWS // 2, 2, P, R, VOCAB, seed=s), rank, world) for s in (16, 17))
    out = {}
    for switch in ("0", None):
        if switch is None:
            os.environ.pop("HYBRIDFLOW_SHM_COLLECTIVES", None)
        else:
            os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = switch
        engine = FSDPEngine(engine_config(fsdp_size=1, micro_batch_size_per_gpu=2), ckpt, "actor")
        metrics = [engine.train_batch(batch, policy_gradient_loss) for batch in (first, second)]
        out[switch or "default"] = (metrics, full_weights(engine, rank), engine._ddp.reduce_after_backward is not None)
    os.environ.pop("HYBRIDFLOW_SHM_COLLECTIVES", None)
    return out


def all_scenarios(rank, world, checkpoints, root):
    out = {arch: _actor_scenario(rank, world, ckpt, os.path.join(root, arch), arch == "qwen2")
           for arch, ckpt in checkpoints.items()}
    out["qwen2_replicated"] = _actor_scenario(rank, world, checkpoints["qwen2"], os.path.join(root, "replicated"),
                                              True, fsdp_size=1)
    out["critic"] = _critic_scenario(rank, world, checkpoints["qwen2"])
    out["skip"] = _skip_scenario(rank, world, checkpoints["qwen2"])
    out["skip_replicated"] = _skip_scenario(rank, world, checkpoints["qwen2"], fsdp_size=1)
    out["prefix"] = _prefix_scenario(rank, world, checkpoints["qwen2"])
    out["prefix_replicated"] = _prefix_scenario(rank, world, checkpoints["qwen2"], fsdp_size=1)
    out["prefetch"] = _prefetch_scenario(rank, world, checkpoints["qwen2"])
    out["gathered"] = _gathered_scenario(rank, world, checkpoints["qwen2"])
    out["token_budget"] = _token_budget_scenario(rank, world, checkpoints["qwen2"])
    out["gradient_reduction"] = _gradient_reduction_scenario(rank, world, checkpoints["qwen2"])
    out["cross_layout"] = _cross_layout_scenario(rank, world, checkpoints["qwen2"], os.path.join(root, "cross"))
    # plain pickle bytes: torch.multiprocessing would ship tensors as shared-memory handles that die
    # with the worker process before the parent reads them
    return pickle.dumps(out)
