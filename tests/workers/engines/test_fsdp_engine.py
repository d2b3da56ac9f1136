"""FSDPEngine on 2 real gloo ranks vs single-process HF references (tiny tied Qwen2, untied Llama).

One spawned 2-rank job runs every scenario (per architecture: log-probs, one step, checkpoint,
HF export, resume; gradient checkpointing and bf16 on Qwen2; the same for Qwen2 in the replicated
layout, fsdp_size=1 (DDP); a critic) and returns its numbers; a 4-rank job checks HSDP (2 x 2);
the tests below check them against references computed here in the parent process, so the
spawn's start-up cost is paid once. The rank side is ``fsdp_scenarios.py``.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridflow.tiny import load_tokenizer, make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import hf_response_log_probs, make_rl_batch, policy_gradient_loss
from tests.workers.engines.fsdp_scenarios import (ADAM_EPS, CLIP, LR, P, R, ROWS, TEMP, VOCAB, WARMUP, WORLD,
                                                  all_scenarios, engine_config, full_weights, rank_share)

# Weights after a step computed in another order (shards, micro-batches, shared prompts, the other
# layout): fp32 sums in another order differ by ~1e-8 in a gradient, and Adam's first step moves a
# weight whose gradient is near eps by lr * dg / eps (~5e-7 at the warm-up lr, more on some CPUs'
# kernels; 1.47e-6 seen in the Megatron twin on an AVX2-only CPU). 5e-6 is 1% of that step's
# largest move (LR / WARMUP), so a wrong row or a missed gradient still fails.
WEIGHT_ATOL = 5e-6


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """One 2-rank job for every scenario: process start-up dominates these tiny runs."""
    root = tmp_path_factory.mktemp("fsdp_engine")
    checkpoints = {arch: make_tiny_checkpoint(str(root / arch / "model"), arch=arch, tied=tied, layers=2, seed=0)
                   for arch, tied in (("qwen2", True), ("llama", False))}
    results = [pickle.loads(r) for r in run_distributed(all_scenarios, WORLD, checkpoints, str(root),
                                                         timeout_s=400)]
    return {"checkpoints": checkpoints, "root": str(root), "results": results}


@pytest.fixture(params=["qwen2", "llama", "qwen2_replicated"], ids=["qwen2_tied", "llama_untied", "qwen2_ddp"])
def actor_run(request, engine_runs):
    key = request.param
    arch, work = ("qwen2", "replicated") if key == "qwen2_replicated" else (key, key)
    return {"ckpt": engine_runs["checkpoints"][arch], "work": os.path.join(engine_runs["root"], work),
            "results": [r[key] for r in engine_runs["results"]]}


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _gather_rows(results, key):
    return torch.cat([r[key] for r in results])


@pytest.mark.slow
def test_log_probs_match_plain_hf(actor_run):
    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    with torch.no_grad():
        ref, mask = hf_response_log_probs(_hf_model(actor_run["ckpt"]), batch, TEMP)
    got = _gather_rows(actor_run["results"], "log_probs")
    assert got.shape == (ROWS, R)
    assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    assert torch.all(got[~mask] == 0)
    packed = _gather_rows(actor_run["results"], "packed_log_probs")
    assert torch.allclose(packed[mask], ref[mask], atol=1e-5, rtol=0)
    entropy = _gather_rows(actor_run["results"], "entropy")
    assert entropy.shape == (ROWS, R) and torch.all(entropy[mask] > 0)


@pytest.mark.slow
def test_one_step_matches_single_process_adamw(actor_run):
    model = _hf_model(actor_run["ckpt"])
    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    # The reference loss is the token mean over the whole batch. The engine gets the same gradient
    # because policy_gradient_loss uses mini_batch_token_mean, which cancels the engine's
    # micro_rows/mini_rows factor and FSDP's 1/dp gradient average (workers/engines/base.py).
    log_probs, mask = hf_response_log_probs(model, batch, TEMP)
    loss = -(batch.batch["advantages"] * log_probs * mask).sum() / mask.sum()
    loss.backward()
    loss = loss.item()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt = torch.optim.AdamW(model.parameters(), lr=LR / WARMUP, weight_decay=0.01, eps=ADAM_EPS)  # warm-up step 0
    opt.step()

    for rank_result in actor_run["results"]:
        metrics = rank_result["step1"]
        assert metrics["lr"] == pytest.approx(LR / WARMUP)
        assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)
        assert metrics["pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert float(ref_norm) > CLIP, "the test should exercise clipping"
    got = actor_run["results"][0]["weights1"]
    expected = {n: p.detach() for n, p in model.named_parameters()}  # tied lm_head appears once
    assert sorted(got) == sorted(expected)
    for name, param in expected.items():
        assert torch.allclose(got[name], param, atol=WEIGHT_ATOL, rtol=0), name


@pytest.mark.slow
def test_checkpoint_round_trip_resumes_identically(actor_run):
    for rank_result in actor_run["results"]:
        assert rank_result["step2_resumed"] == rank_result["step2"]
        assert rank_result["versions"] == [2, 1]  # what tells the hybrid worker to sync vLLM
    before, after = actor_run["results"][0]["weights2"], actor_run["results"][0]["weights2_resumed"]
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.slow
def test_save_hf_loads_in_transformers_with_same_outputs(actor_run):
    hf_dir = os.path.join(actor_run["work"], "hf")
    model = _hf_model(hf_dir)
    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    with torch.no_grad():
        ref, mask = hf_response_log_probs(model, batch, TEMP)
    got = _gather_rows(actor_run["results"], "log_probs_after")
    assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    weights1 = actor_run["results"][0]["weights1"]
    for name, param in model.state_dict().items():
        if name in weights1:
            assert torch.equal(param, weights1[name]), name
    tokenizer = load_tokenizer(hf_dir)
    assert tokenizer.decode(tokenizer("12 + 3 = 15").input_ids) == "12 + 3 = 15"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["qwen2", "qwen2_replicated"])
def test_gradient_checkpointing_and_bf16_train_the_same_step(engine_runs, key):
    for result in (r[key] for r in engine_runs["results"]):
        exact, recomputed, bf16 = result["step1"], result["step1_checkpointed"], result["step1_bf16"]
        assert recomputed["grad_norm"] == pytest.approx(exact["grad_norm"], rel=1e-5)
        assert recomputed["pg_loss"] == pytest.approx(exact["pg_loss"], rel=1e-5)
        # bf16 compute (fp32 master weights): same step up to bf16 rounding
        assert bf16["grad_norm"] == pytest.approx(exact["grad_norm"], rel=0.05)
        assert torch.allclose(result["log_probs_bf16"], result["log_probs"], atol=0.1)


@pytest.mark.slow
def test_critic_values_align_with_hf_and_regression_reduces_loss(engine_runs):
    from transformers import AutoConfig, AutoModelForTokenClassification

    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=3)
    mask = batch.batch["response_mask"].bool()
    values = _gather_rows([r["critic"] for r in engine_runs["results"]], "values")
    assert values.shape == (ROWS, R) and torch.isfinite(values).all()
    assert torch.all(values[~mask] == 0)
    # the engine seeds the fresh value head with config.seed; the same seed here gives the same head
    torch.manual_seed(0)
    path = engine_runs["checkpoints"]["qwen2"]
    config = AutoConfig.from_pretrained(path)
    config.num_labels, config.classifier_dropout = 1, 0.0
    ref_model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32).eval()
    b = batch.batch
    with torch.no_grad():
        ref = ref_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=b["position_ids"]).logits[:, P - 1:-1, 0]
    assert torch.allclose(values[mask], ref[mask], atol=1e-5, rtol=0)

    losses = engine_runs["results"][0]["critic"]["losses"]
    assert losses[0] > losses[1] > losses[2]
    after = _gather_rows([r["critic"] for r in engine_runs["results"]], "values_after")
    def mse(v):
        return float(((v - b["returns"]) ** 2)[mask].mean())
    assert mse(after) < mse(values)
    assert losses[0] == pytest.approx(mse(values), rel=1e-5)


def _hsdp_scenario(rank, world, ckpt):
    from workers.engines.fsdp import FSDPEngine

    data = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    data.meta_info["temperature"] = TEMP
    # 2 micro-batches per rank: the first defers the cross-replica all-reduce to the second
    engine = FSDPEngine(engine_config(fsdp_size=2, micro_batch_size_per_gpu=1), ckpt, "actor")
    assert engine.shard_size == 2
    metrics = engine.train_batch(rank_share(data, rank, world), policy_gradient_loss)
    return pickle.dumps({"step1": metrics, "weights1": full_weights(engine, rank)})


@pytest.mark.slow
def test_hsdp_step_matches_full_sharding(engine_runs):
    """HSDP on 4 ranks (2 replicas x 2 shards) takes the same step as FSDP over 2 ranks."""
    ckpt = engine_runs["checkpoints"]["qwen2"]
    results = [pickle.loads(r) for r in run_distributed(_hsdp_scenario, 4, ckpt, timeout_s=300)]
    fsdp = engine_runs["results"][0]["qwen2"]
    for result in results:
        assert result["step1"]["grad_norm"] == pytest.approx(fsdp["step1"]["grad_norm"], rel=1e-5)
        assert result["step1"]["pg_loss"] == pytest.approx(fsdp["step1"]["pg_loss"], rel=1e-5, abs=1e-6)
    for name, param in fsdp["weights1"].items():
        assert torch.allclose(results[0]["weights1"][name], param, atol=WEIGHT_ATOL, rtol=0), name


@pytest.mark.parametrize("key", ["skip", "skip_replicated"])
def test_skipping_zero_advantage_rows_takes_the_same_step(engine_runs, key):
    """Rows with zero advantage left out (padded unevenly, then none left at all) and micro-batches
    of 1 instead of 2: the same weights as computing every row, because the objective is
    aggregated over the whole mini-batch."""
    run = engine_runs["results"][0][key]
    assert run["skip_metrics1"]["skipped_rows_frac"] == pytest.approx(3 / 8)
    assert run["skip_metrics2"]["skipped_rows_frac"] == 1.0
    assert "skipped_rows_frac" not in run["full_metrics1"]
    for step in (1, 2):
        for other in ("skip", "micro1"):
            for name, param in run[f"full_weights{step}"].items():
                assert torch.allclose(run[f"{other}_weights{step}"][name], param, atol=WEIGHT_ATOL, rtol=0), (other, step, name)
    # with nothing to compute, the optimizer still stepped (AdamW's momentum and weight decay)
    assert any(not torch.equal(run["skip_weights1"][n], run["skip_weights2"][n]) for n in run["skip_weights1"])
    assert run["skip_metrics1"]["actor/pg_loss"] != 0.0 and run["skip_metrics2"]["grad_norm"] == 0.0
    # generating with the module (rollout.name=hf) left no gathered copy behind to go stale
    if key == "skip":
        assert run["sharded_after_generate"]
    torch.testing.assert_close(run["skip_log_probs_after"], run["full_log_probs_after"], atol=1e-5, rtol=0)


def test_checkpoint_resumes_in_the_other_parameter_layout(engine_runs):
    """Replicated -> sharded and sharded -> replicated: the resumed engine takes the same next
    step (loss, gradient norm, weights) as the one that saved."""
    for (saved, loaded), (ref, got, ref_weights, got_weights) in engine_runs["results"][0]["cross_layout"].items():
        assert got["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6), (saved, loaded)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (saved, loaded)
        for name, param in ref_weights.items():
            assert torch.allclose(got_weights[name], param, atol=WEIGHT_ATOL, rtol=0), (saved, loaded, name)


@pytest.mark.parametrize("key", ["prefix", "prefix_replicated"])
def test_shared_prompt_forward_gives_the_same_log_probs_and_step(engine_runs, key):
    """One forward per distinct prompt (its KV cache shared by the group's samples), sharded FSDP
    and DDP: the same log-probs, loss, gradient norm and updated weights as every row on its own."""
    for result in engine_runs["results"]:
        (lp0, m0, lp1, w0, calls), (lp0_s, m0_s, lp1_s, w_s, calls_s) = result[key][False], result[key][True]
        assert calls == 0 and calls_s >= 3  # of 6 micro-batches (2 in each of 3 passes); short prompts save too little
        assert torch.allclose(lp0_s, lp0, atol=1e-5, rtol=0) and torch.allclose(lp1_s, lp1, atol=1e-5, rtol=0)
        assert m0_s["pg_loss"] == pytest.approx(m0["pg_loss"], abs=1e-6)
        assert m0_s["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
        for name, param in (w0 or {}).items():  # rank 0 holds the full weights
            assert torch.allclose(w_s[name], param, atol=WEIGHT_ATOL, rtol=0), name


def _assert_same_numbers(a, b):
    """Two runs of (log-probs before, step 1 metrics, step 2 metrics, log-probs after, weights, _)
    equal bit for bit."""
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])
    for m_a, m_b in ((a[1], b[1]), (a[2], b[2])):
        assert m_a["pg_loss"] == m_b["pg_loss"] and m_a["grad_norm"] == m_b["grad_norm"]


def test_prefetching_parameter_gathers_changes_no_number(engine_runs):
    """forward_prefetch (the CPU default) issues each layer's all-gather one layer ahead, async:
    log-probs, losses, gradient norms and weights after two steps equal the blocking gathers'."""
    for result in engine_runs["results"]:
        off, on = result["prefetch"][False], result["prefetch"][True]
        assert not any(off[5]) and all(on[5])
        _assert_same_numbers(on, off)
    run = engine_runs["results"][0]["prefetch"]
    for name, param in run[False][4].items():
        assert torch.equal(run[True][4][name], param), name


def test_keeping_gathered_parameters_through_a_call_changes_no_number(engine_runs):
    """reshard_after_forward=false gathers each layer once per engine call and reshards when the
    call ends: log-probs (the second one after two steps, so no stale gathered copy is read),
    losses, gradient norms and weights equal the per-micro-batch gathers', bit for bit."""
    for result in engine_runs["results"]:
        default, kept = result["gathered"][True], result["gathered"][False]
        assert all(kept[5])  # (the default leaves the root's parameters gathered after a forward-only pass)
        _assert_same_numbers(kept, default)
    run = engine_runs["results"][0]["gathered"]
    for name, param in run[True][4].items():
        assert torch.equal(run[False][4][name], param), name


def test_token_budget_micro_batches_take_the_same_step(engine_runs):
    runs = [r["token_budget"] for r in engine_runs["results"]]
    # the budget really cut uneven micro-batches, and the same number on both ranks
    assert len({len(run["micro_rows"]) for run in runs}) == 1 and any(len(set(r["micro_rows"])) > 1 for r in runs)
    for run in runs:
        fixed, budget = run["fixed"], run["budget"]
        torch.testing.assert_close(budget[0], fixed[0], atol=1e-5, rtol=0)
        assert budget[1]["pg_loss"] == pytest.approx(fixed[1]["pg_loss"], abs=1e-6)
        assert budget[1]["grad_norm"] == pytest.approx(fixed[1]["grad_norm"], rel=1e-5)
        torch.testing.assert_close(budget[2], fixed[2], atol=1e-5, rtol=0)
        for name, param in (fixed[3] or {}).items():  # rank 0 gathers the full weights
            assert torch.allclose(budget[3][name], param, atol=WEIGHT_ATOL, rtol=0), name


@pytest.mark.slow
def test_gradients_reduced_after_backward_through_shared_memory_take_the_same_steps(engine_runs):
    """Two replicas on a core each reduce their gradients through shared memory once backward ends
    (workers/engines/fsdp_layout.py ReduceAfterBackward) where vLLM's CPU kernels are, and give
    DDP's gloo all-reduce's metrics and weights bit for bit (2 ranks: the same two-term sums)."""
    from hybridflow import shm_group

    results = [r["gradient_reduction"] for r in engine_runs["results"]]
    assert [r["0"][2] for r in results] == [False, False]  # HYBRIDFLOW_SHM_COLLECTIVES=0: gloo
    if not shm_group._kernels_available():
        pytest.skip("vLLM's CPU build has no shared-memory kernels on this CPU (AVX2-only): gloo is the only path")
    assert [r["default"][2] for r in results] == [True, True]
    gloo, shared = results[0]["0"], results[0]["default"]
    assert gloo[0] == shared[0]
    assert gloo[1].keys() == shared[1].keys()
    for name in gloo[1]:
        assert torch.equal(gloo[1][name], shared[1][name]), name
    initial = _hf_model(engine_runs["checkpoints"]["qwen2"]).state_dict()
    assert any(not torch.equal(initial[name], weight) for name, weight in shared[1].items())  # they trained
