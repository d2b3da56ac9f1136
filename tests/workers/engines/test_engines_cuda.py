"""Both training engines on a GPU (CUDA + NCCL): the same numerics checks as the CPU tests, on one
rank, since a GPU can hold only one NCCL rank. Skipped where no GPU is visible (CI has none).

What runs on the device: log-probs and entropy (fp32, against the HF model), one AdamW step
against a single-process reference, save -> load -> identical next step, HF export, the critic's
values, bf16 compute with fp32 master weights, and host offload of parameters and optimizer state
(a no-op on CPU, so only a GPU exercises it). References are computed here on the CPU: equal
within fp32 tolerance means the GPU path computes what the CPU path does.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.test_megatron_engine import (CLIP, P, R, ROWS, TEMP, VOCAB, _batch, _config,
                                                        _entropy_pg_loss, _hf_model, _pg_entropy_loss,
                                                        _reference_log_probs_and_entropy, _reference_step,
                                                        _weights)
from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch, value_loss

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

STRATEGIES = ("fsdp", "megatron")


def _engine(strategy, ckpt, role="actor", **overrides):
    from dataclasses import replace

    config = replace(_config(1, 1, **overrides), strategy=strategy)
    if strategy == "fsdp":
        from workers.engines.fsdp import FSDPEngine

        return FSDPEngine(config, ckpt, role)
    from workers.engines.megatron import MegatronEngine

    return MegatronEngine(config, ckpt, role)


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _allocated():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _scenario(rank, world, ckpt, workdir):
    from megatron.core import parallel_state as ps

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the comparisons
    torch.backends.cudnn.allow_tf32 = False
    out = {"device": torch.cuda.get_device_name(0)}
    first, second = _batch(1), _batch(2)
    for strategy in STRATEGIES:
        res = out[strategy] = {}
        engine = _engine(strategy, ckpt)
        res["param_device"] = next(engine.model.parameters()).device.type
        res["log_probs"], res["entropy"] = engine.compute_log_prob(first, TEMP, calculate_entropy=True)
        res["step1"] = engine.train_batch(first, _entropy_pg_loss)
        res["weights1"] = _weights(engine, rank)
        folder = os.path.join(workdir, strategy)
        engine.save_checkpoint(os.path.join(folder, "ckpt"))
        engine.save_hf(os.path.join(folder, "hf"))
        res["step2"] = engine.train_batch(second, _entropy_pg_loss)
        del engine
        resumed = _engine(strategy, ckpt)
        resumed.load_checkpoint(os.path.join(folder, "ckpt"))
        res["step2_resumed"] = resumed.train_batch(second, _entropy_pg_loss)
        del resumed

        critic = _engine(strategy, ckpt, role="critic")
        res["values"] = critic.compute_values(first)
        res["critic_step"] = critic.train_batch(first, value_loss)
        del critic

        mixed = _engine(strategy, ckpt, param_dtype="bf16")
        res["bf16_log_probs"], _ = mixed.compute_log_prob(first, TEMP)
        res["bf16_step"] = mixed.train_batch(first, _entropy_pg_loss)
        res["bf16_weights"] = _weights(mixed, rank)
        del mixed

        # the other forward paths: prompts shared among a group's rows (GRPO), packed rows
        # without padding (FSDP's use_remove_padding), activation recomputation in backward
        grouped = make_grouped_rl_batch(4, 2, P, R, VOCAB, seed=6)
        for share in (False, True):
            shared = _engine(strategy, ckpt, share_prompt_prefix=share, micro_batch_size_per_gpu=4)
            res[f"grouped_log_probs_{share}"], _ = shared.compute_log_prob(grouped, TEMP)
            del shared
        if strategy == "fsdp":
            packed = _engine(strategy, ckpt, use_remove_padding=True)
            res["packed_log_probs"], _ = packed.compute_log_prob(first, TEMP)
            del packed
        recompute = _engine(strategy, ckpt, gradient_checkpointing=True)
        recompute.train_batch(first, _entropy_pg_loss)
        res["recompute_weights1"] = _weights(recompute, rank)
        del recompute

        # verl's param_offload / optimizer_offload: between calls the state rests in host memory
        torch.cuda.empty_cache()
        before = _allocated()
        resting = _engine(strategy, ckpt, optimizer_offload=True, param_offload=True)
        resting.train_batch(first, _entropy_pg_loss)
        res["offload_rest_bytes"] = _allocated() - before
        res["model_bytes"] = sum(p.numel() * p.element_size() for p in resting.model.parameters())
        res["offload_optimizer_device"] = {s.device.type for st in resting.optimizer.state.values()
                                           for s in st.values() if isinstance(s, torch.Tensor) and s.dim()}
        res["offload_weights1"] = _weights(resting, rank)
        del resting
        if strategy == "megatron":
            ps.destroy_model_parallel()
        torch.cuda.empty_cache()
    return pickle.dumps(_cpu(out))


@pytest.fixture(scope="module", params=[("qwen2", True), ("llama", False)], ids=["qwen2_tied", "llama_untied"])
def run(request, tmp_path_factory):
    arch, tied = request.param
    root = tmp_path_factory.mktemp(f"cuda_{arch}")
    ckpt = make_tiny_checkpoint(str(root / "model"), arch=arch, tied=tied, layers=2, seed=0)
    result = pickle.loads(run_distributed(_scenario, 1, ckpt, str(root / "work"), timeout_s=600)[0])
    return {"ckpt": ckpt, "work": str(root / "work"), **result}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_log_probs_and_entropy_on_gpu_match_hf(run, strategy):
    assert run[strategy]["param_device"] == "cuda", run["device"]
    ref, ref_entropy, mask = _reference_log_probs_and_entropy(run["ckpt"])
    got, entropy = run[strategy]["log_probs"], run[strategy]["entropy"]
    assert got.shape == (ROWS, R)
    assert (got[mask] - ref[mask]).abs().max() < 1e-4
    assert (entropy[mask] - ref_entropy[mask]).abs().max() < 1e-4
    if strategy == "fsdp":
        assert (run[strategy]["packed_log_probs"][mask] - ref[mask]).abs().max() < 1e-4
    # bf16 compute: close to the fp32 numbers, not equal (8 mantissa bits)
    assert (run[strategy]["bf16_log_probs"][mask] - ref[mask]).abs().mean() < 0.05


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_step_on_gpu_matches_single_process_adamw(run, strategy):
    model = _hf_model(run["ckpt"])
    loss, norm = _reference_step(model, _batch(1), _pg_entropy_loss)
    assert norm > CLIP, "the test should exercise clipping"
    metrics = run[strategy]["step1"]
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    expected = {n: p.detach() for n, p in model.named_parameters()}
    # offloading moves state and recomputation repeats forwards: neither changes the math
    for label in ("weights1", "offload_weights1", "recompute_weights1"):
        got = run[strategy][label]
        assert sorted(got) == sorted(expected)
        for name, param in expected.items():
            assert (got[name] - param).abs().max() < 1e-5, (label, name)
    # bf16 compute keeps fp32 master weights: the step lands near the fp32 one (the export is in
    # the compute dtype, bf16 for Megatron: within bf16's rounding of weights ~0.1)
    for name, param in expected.items():
        assert (run[strategy]["bf16_weights"][name].float() - param).abs().max() < 5e-3, name
    assert torch.isfinite(torch.tensor(run[strategy]["bf16_step"]["grad_norm"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_on_gpu_gives_the_same_next_step(run, strategy):
    res = run[strategy]
    for key in ("pg_loss", "grad_norm"):
        assert res["step2_resumed"][key] == pytest.approx(res["step2"][key], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_export_from_gpu_loads_in_transformers(run, strategy):
    exported = _hf_model(os.path.join(run["work"], strategy, "hf"))
    got = dict(exported.named_parameters())
    for name, param in run[strategy]["weights1"].items():
        assert torch.equal(got[name].detach(), param), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_critic_values_and_step_on_gpu(run, strategy):
    values = run[strategy]["values"]
    assert values.shape == (ROWS, R) and torch.isfinite(values).all()
    assert run[strategy]["critic_step"]["vf_loss"] > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_state_rests_in_host_memory(run, strategy):
    res = run[strategy]
    assert res["offload_optimizer_device"] == {"cpu"}
    # with parameters and optimizer state offloaded nothing of the model's size stays on the device
    rest, model = res["offload_rest_bytes"], res["model_bytes"]
    assert rest < 0.1 * model, (rest, model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prompt_forward_on_gpu_matches_one_forward_per_row(run, strategy):
    plain, shared = run[strategy]["grouped_log_probs_False"], run[strategy]["grouped_log_probs_True"]
    assert (plain - shared).abs().max() < 1e-4
