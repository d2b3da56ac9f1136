"""MegatronEngine on 4 real gloo ranks vs single-process HF references (tiny tied Qwen2, untied
Llama, tied Qwen3: per-head q/k norms, head_dim twice hidden/heads).

One spawned job per architecture runs every layout in turn (TP2xPP2, TP1xDP4, TP2xDP2, PP2xDP2),
re-building megatron-core's process groups between them, and returns its numbers; the tests below
compare them with references computed here, so the spawn cost is paid once per architecture.
"""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridflow.tiny import load_tokenizer, make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import (hf_response_log_probs, make_grouped_rl_batch, make_rl_batch,
                                                policy_gradient_loss, value_loss)

WORLD, ROWS, P, R, VOCAB = 4, 8, 8, 8, 128
TEMP, LR, CLIP = 0.7, 1e-3, 1.0
ADAM_EPS = 1e-5  # see test_fsdp_engine.py: keeps Adam's first step well conditioned for the comparison
# Weights after one step computed in another order (shared prompts, other micro-batches): fp32
# sums in another order differ by ~1e-8 in a gradient, and Adam's first step moves a weight whose
# gradient is near eps by lr * dg / eps ~ 1e-6 (1.47e-6 seen on an AVX2-only CPU). 1e-5 is 1% of
# the largest first-step move (lr), so a wrong row or a missed gradient still fails.
WEIGHT_ATOL = 1e-5
LAYOUTS = {"tp2pp2": (2, 2), "tp1dp4": (1, 1), "tp2dp2": (2, 1), "pp2dp2": (1, 2)}


def _config(tp, pp, **overrides):
    from workers.engines.config import EngineConfig

    base = dict(strategy="megatron", tp=tp, pp=pp, lr=LR, adam_eps=ADAM_EPS, lr_schedule="constant",
                grad_clip=CLIP, weight_decay=0.01, micro_batch_size_per_gpu=2, seed=0)
    return EngineConfig(**{**base, **overrides})


def _batch(seed):
    data = make_rl_batch(ROWS, P, R, VOCAB, seed=seed)
    data.meta_info.update(temperature=TEMP, calculate_entropy=True)
    return data


def _share(data, engine):
    n = len(data) // engine.dp_size
    return data[engine.dp_rank * n:(engine.dp_rank + 1) * n]


def _weights(engine, rank):
    weights = {name: t.clone() for name, t in engine.export_hf_weights()}
    return weights if rank == 0 else None


def _entropy_pg_loss(outputs, micro):
    """policy_gradient_loss plus a small entropy bonus, so the entropy path is trained too."""
    from workers.engines.base import mini_batch_token_mean

    loss, metrics = policy_gradient_loss(outputs, micro)
    bonus = mini_batch_token_mean(outputs["entropy"], micro.batch["response_mask"].float(), micro)
    return loss - 0.01 * bonus, metrics


def _prompt_sharing(ckpt, tp, pp, rank):
    """GRPO-shaped batch (4 prompts x 2 samples, 2 distinct prompts per micro-batch): log-probs,
    entropy and one step with each prompt run once vs once per row. Counts the shared forwards."""
    from megatron.core import parallel_state as ps

    from workers.engines.megatron import MegatronEngine
    from workers.models.transformer import MegatronCausalLM

    calls = []
    shared_forward = MegatronCausalLM._forward_shared

    def counted(self, *args, **kwargs):
        calls.append(1)
        return shared_forward(self, *args, **kwargs)

    MegatronCausalLM._forward_shared = counted
    data = make_grouped_rl_batch(4, 2, P, R, VOCAB, seed=6)
    data.meta_info.update(temperature=TEMP, calculate_entropy=True)
    out = {}
    try:
        for share in (False, True):
            ps.destroy_model_parallel()
            engine = MegatronEngine(_config(tp, pp, share_prompt_prefix=share, micro_batch_size_per_gpu=4), ckpt,
                                    "actor")
            mine = _share(data, engine)
            lp, ent = engine.compute_log_prob(mine, TEMP, calculate_entropy=True)
            out[share] = dict(log_probs=lp, entropy=ent, step=engine.train_batch(mine, _entropy_pg_loss),
                              weights=_weights(engine, rank), calls=len(calls))
    finally:
        MegatronCausalLM._forward_shared = shared_forward
    return out


def _scenario(rank, world, ckpt, workdir):
    from megatron.core import parallel_state as ps

    # every TP layout below runs its all-reduces on the opt-in shared-memory groups, so the
    # numerics checks cover that path too (the default, gloo, is what every other test runs)
    os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = "1"

    from workers.engines.megatron import MegatronEngine, init_model_parallel

    out: dict = {}
    try:
        init_model_parallel(3, 1)
    except ValueError as err:
        out["world_error"] = str(err)
    first, second = _batch(1), _batch(2)
    for name, (tp, pp) in LAYOUTS.items():
        res = out[name] = {}
        engine = MegatronEngine(_config(tp, pp), ckpt, "actor")
        res["coords"] = (engine.dp_rank, engine.dp_size, engine.is_collect)
        res["tp_group"] = type(ps.get_tensor_model_parallel_group()).__name__
        mine, mine2 = _share(first, engine), _share(second, engine)
        res["log_probs"], res["entropy"] = engine.compute_log_prob(mine, TEMP, calculate_entropy=True)
        res["step1"] = engine.train_batch(mine, _entropy_pg_loss)
        res["weights1"] = _weights(engine, rank)
        if name == "tp2pp2":
            engine.save_checkpoint(os.path.join(workdir, "ckpt"))
            engine.save_hf(os.path.join(workdir, "hf"))
            res["log_probs_after"], _ = engine.compute_log_prob(mine, TEMP)
            res["step2"] = engine.train_batch(mine2, _entropy_pg_loss)
            resumed = MegatronEngine(_config(tp, pp), ckpt, "actor")
            resumed.load_checkpoint(os.path.join(workdir, "ckpt"))
            res["step2_resumed"] = resumed.train_batch(mine2, _entropy_pg_loss)
            res["sharing"] = _prompt_sharing(ckpt, tp, pp, rank)
            critic = MegatronEngine(_config(tp, pp), ckpt, "critic")
            res["critic_init"] = _weights(critic, rank)
            res["values"] = critic.compute_values(mine)
            res["critic_step"] = critic.train_batch(mine, value_loss)
            res["critic_weights1"] = _weights(critic, rank)
        if name == "pp2dp2":  # zero-advantage rows skipped: dp rank 0 keeps 1 of 4 rows, then none
            from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn

            objective = ActorObjective()
            skip_batches = (_batch(4), _batch(5))
            skip_batches[0].batch["advantages"][1:4] = 0.0
            skip_batches[1].batch["advantages"][:] = 0.0
            for label, skip in (("full", False), ("skip", True)):
                trained = MegatronEngine(_config(tp, pp), ckpt, "actor")
                for step, batch in enumerate(skip_batches, start=1):
                    part = _share(batch, trained)
                    res[f"{label}_metrics{step}"] = trained.train_batch(
                        part, make_actor_loss_fn(objective), skip_rows=objective.inert_rows(part.batch) if skip else None)
                    res[f"{label}_weights{step}"] = _weights(trained, rank)
            # use_dynamic_bsz: micro-batches of uneven rows through the pipeline, counts evened over DP
            budget_batch, budget = _batch(7), 3 * (P + R) // 2
            for label, kwargs in (("fixed", {}), ("budget", dict(max_token_len_per_gpu=budget,
                                                                infer_max_token_len_per_gpu=budget))):
                trained = MegatronEngine(_config(tp, pp, **kwargs), ckpt, "actor")
                part = _share(budget_batch, trained)
                res[f"{label}_budget"] = (trained.compute_log_prob(part, TEMP)[0],
                                          trained.train_batch(part, _entropy_pg_loss), _weights(trained, rank))
        if name == "tp2dp2":
            try:
                engine.load_checkpoint(os.path.join(workdir, "ckpt"))
            except ValueError as err:
                res["layout_error"] = str(err)
        ps.destroy_model_parallel()
    mixed = MegatronEngine(_config(2, 2, param_dtype="bf16"), ckpt, "actor")
    mine = _share(first, mixed)
    out["bf16"] = {"coords": (mixed.dp_rank, mixed.dp_size, mixed.is_collect)}
    out["bf16"]["log_probs"], _ = mixed.compute_log_prob(mine, TEMP)
    out["bf16"]["step1"] = mixed.train_batch(mine, _entropy_pg_loss)
    out["bf16"]["master_dtypes"] = {p.dtype for p in mixed.grads.master_params}
    ps.destroy_model_parallel()
    return pickle.dumps(out)


@pytest.fixture(scope="module", params=[("qwen2", True), ("llama", False), ("qwen3", True)],
                ids=["qwen2_tied", "llama_untied", "qwen3_tied"])
def run(request, tmp_path_factory):
    arch, tied = request.param
    root = tmp_path_factory.mktemp(arch)
    ckpt = make_tiny_checkpoint(str(root / "model"), arch=arch, tied=tied, layers=2, seed=0)
    # On this CPU kind oneDNN picks AMX kernels for bf16 Linear that die with SIGILL (AMX is
    # advertised but not enabled); capping the ISA keeps bf16 on AVX512-BF16. Spawned workers inherit it.
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    results = [pickle.loads(r) for r in run_distributed(_scenario, WORLD, ckpt, str(root / "work"), timeout_s=400)]
    return {"ckpt": ckpt, "work": str(root / "work"), "results": results}


def _collected(results, layout, key):
    """Rows of ``key`` from the collect ranks, in data-parallel order (the whole batch)."""
    parts = sorted((r[layout]["coords"][0], r[layout][key]) for r in results if r[layout]["coords"][2])
    return torch.cat([p for _, p in parts])


def _hf_model(path, cls="AutoModelForCausalLM"):
    import transformers

    return getattr(transformers, cls).from_pretrained(path, dtype=torch.float32).eval()


def _reference_step(model, data, loss_of):
    loss = loss_of(model, data)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=ADAM_EPS).step()
    return loss.item(), float(norm)


def _pg_entropy_loss(model, data):
    log_probs, mask = hf_response_log_probs(model, data, TEMP)
    b = data.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits.float()[:, P - 1:-1] / TEMP
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    pg = -(b["advantages"] * log_probs * mask).sum() / mask.sum()
    return pg - 0.01 * (entropy * mask).sum() / mask.sum()


@pytest.mark.slow
def test_layout_coordinates_and_errors(run):
    results = run["results"]
    assert "world size 4 is not tp*pp*dp for tp=3, pp=1" in results[0]["world_error"]
    # megatron-core rank order: rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    assert [r["tp2pp2"]["coords"] for r in results] == [(0, 1, False), (0, 1, False), (0, 1, True), (0, 1, False)]
    assert [r["tp2dp2"]["coords"] for r in results] == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    assert [r["pp2dp2"]["coords"][:2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert "saved with tp=2, pp=2 but this engine runs tp=2, pp=1" in results[0]["tp2dp2"]["layout_error"]
    # asked for (HYBRIDFLOW_SHM_COLLECTIVES=1), TP all-reduces go through shared memory where this
    # CPU has vLLM's kernels (AVX512 builds; HYBRIDFLOW_CPU_ISA=avx2 hides them), else plain gloo
    from hybridflow import shm_group

    shared = shm_group._kernels_available()
    for name, (tp, _) in LAYOUTS.items():
        assert {r[name]["tp_group"] for r in results} == ({"SharedMemoryGroup"} if tp > 1 and shared else {"ProcessGroup"})


def _reference_log_probs_and_entropy(ckpt):
    """The HF model's response log-probs and entropy on ``_batch(1)``, and the response mask."""
    model = _hf_model(ckpt)
    batch = _batch(1)
    with torch.no_grad():
        ref, mask = hf_response_log_probs(model, batch, TEMP)
        b = batch.batch
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.float()[:, P - 1:-1] / TEMP
        ref_entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return ref, ref_entropy, mask


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_and_entropy_match_hf(run, layout):
    ref, ref_entropy, mask = _reference_log_probs_and_entropy(run["ckpt"])
    got = _collected(run["results"], layout, "log_probs")
    entropy = _collected(run["results"], layout, "entropy")
    assert got.shape == (ROWS, R)
    assert (got[mask] - ref[mask]).abs().max() < 1e-4
    assert (entropy[mask] - ref_entropy[mask]).abs().max() < 1e-4
    assert torch.all(got[~mask] == 0) and torch.all(entropy[~mask] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_single_process_adamw(run, layout):
    model = _hf_model(run["ckpt"])
    loss, norm = _reference_step(model, _batch(1), _pg_entropy_loss)
    assert norm > CLIP, "the test should exercise clipping"
    for rank_result in run["results"]:
        metrics = rank_result[layout]["step1"]
        assert metrics["lr"] == pytest.approx(LR)
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    got = run["results"][0][layout]["weights1"]
    expected = {n: p.detach() for n, p in model.named_parameters()}  # a tied lm_head appears once
    assert sorted(got) == sorted(expected)
    for name, param in expected.items():
        assert (got[name] - param).abs().max() < 1e-5, name


@pytest.mark.slow
def test_bf16_compute_with_fp32_master_weights_tracks_fp32(run):
    with torch.no_grad():
        ref, mask = hf_response_log_probs(_hf_model(run["ckpt"]), _batch(1), TEMP)
    got = _collected(run["results"], "bf16", "log_probs")
    assert (got[mask] - ref[mask]).abs().mean() < 0.05  # bf16 rounding, not a different model
    fp32_step, bf16_step = run["results"][0]["tp2pp2"]["step1"], run["results"][0]["bf16"]["step1"]
    assert bf16_step["grad_norm"] == pytest.approx(fp32_step["grad_norm"], rel=0.05)
    assert run["results"][0]["bf16"]["master_dtypes"] == {torch.float32}


@pytest.mark.slow
def test_checkpoint_resume_gives_identical_next_step(run):
    for rank_result in run["results"]:
        res = rank_result["tp2pp2"]
        assert res["step2_resumed"] == res["step2"]
        assert res["step2"]["pg_loss"] != res["step1"]["pg_loss"]


@pytest.mark.slow
def test_save_hf_of_tp2_pp2_loads_in_transformers(run):
    hf_dir = os.path.join(run["work"], "hf")
    model = _hf_model(hf_dir)
    with torch.no_grad():
        ref, mask = hf_response_log_probs(model, _batch(1), TEMP)
    got = _collected(run["results"], "tp2pp2", "log_probs_after")
    assert (got[mask] - ref[mask]).abs().max() < 1e-4
    weights1 = run["results"][0]["tp2pp2"]["weights1"]
    for name, param in model.state_dict().items():
        if name in weights1:
            assert torch.equal(param, weights1[name]), name
    tokenizer = load_tokenizer(hf_dir)
    assert tokenizer.decode(tokenizer("12 + 3 = 15").input_ids) == "12 + 3 = 15"


@pytest.mark.slow
def test_critic_values_and_step_match_hf_token_classification(run, tmp_path):
    from transformers import AutoConfig, AutoModelForTokenClassification

    res0 = run["results"][0]["tp2pp2"]
    config = AutoConfig.from_pretrained(run["ckpt"], num_labels=1)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(res0["critic_init"], strict=True)
    data = _batch(1)
    b = data.batch
    mask = b["response_mask"].bool()

    def values_of(m):
        return m(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                 position_ids=b["position_ids"]).logits[:, P - 1:-1, 0]

    with torch.no_grad():
        ref_values = values_of(model)
    got = _collected(run["results"], "tp2pp2", "values")
    assert (got[mask] - ref_values[mask]).abs().max() < 1e-4

    def loss_of(m, _):
        return (((values_of(m) - b["returns"]) ** 2) * mask).sum() / mask.sum()

    loss, norm = _reference_step(model, data, loss_of)
    assert res0["critic_step"]["vf_loss"] == pytest.approx(loss, rel=1e-5)
    assert res0["critic_step"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for name, param in model.named_parameters():
        assert (res0["critic_weights1"][name] - param.detach()).abs().max() < 1e-5, name


@pytest.mark.slow
def test_prompt_sharing_gives_the_same_outputs_and_step(run):
    """TP2 x PP2: every stage runs each distinct prompt once; outputs and the step are unchanged."""
    for rank, rank_result in enumerate(run["results"]):
        off, on = rank_result["tp2pp2"]["sharing"][False], rank_result["tp2pp2"]["sharing"][True]
        assert off["calls"] == 0 and on["calls"] > 0, "the shared forward did not run"
        mask = make_grouped_rl_batch(4, 2, P, R, VOCAB, seed=6).batch["response_mask"].bool()  # dp = 1: all rows
        assert (on["log_probs"] - off["log_probs"])[mask].abs().max() < 1e-5
        assert (on["entropy"] - off["entropy"])[mask].abs().max() < 1e-5
        assert on["step"]["grad_norm"] == pytest.approx(off["step"]["grad_norm"], rel=1e-5)
        assert on["step"]["pg_loss"] == pytest.approx(off["step"]["pg_loss"], rel=1e-5)
        if rank == 0:
            for name, param in off["weights"].items():
                assert (on["weights"][name] - param).abs().max() < WEIGHT_ATOL, name


def test_skipping_zero_advantage_rows_takes_the_same_step(run):
    """PP=2 x DP=2: the rows left out (unevenly over DP, then all of them) change no weight."""
    res = run["results"][0]["pp2dp2"]
    assert res["skip_metrics1"]["skipped_rows_frac"] == pytest.approx(3 / 8)
    assert res["skip_metrics2"]["skipped_rows_frac"] == 1.0
    for step in (1, 2):
        for name, param in res[f"full_weights{step}"].items():
            assert torch.allclose(res[f"skip_weights{step}"][name], param, atol=WEIGHT_ATOL, rtol=0), (step, name)


def test_token_budget_micro_batches_take_the_same_step(run):
    """PP=2 x DP=2 with use_dynamic_bsz: the same log-probs, loss and weights as 2-row micro-batches."""
    for rank, rank_result in enumerate(run["results"]):
        res = rank_result["pp2dp2"]
        (lp_fixed, step_fixed, w_fixed), (lp_budget, step_budget, w_budget) = res["fixed_budget"], res["budget_budget"]
        torch.testing.assert_close(lp_budget, lp_fixed, atol=1e-5, rtol=0)
        assert step_budget["grad_norm"] == pytest.approx(step_fixed["grad_norm"], rel=1e-5)
        assert step_budget["pg_loss"] == pytest.approx(step_fixed["pg_loss"], abs=1e-6)
        for name, param in (w_fixed or {}).items():
            assert torch.allclose(w_budget[name], param, atol=WEIGHT_ATOL, rtol=0), name
