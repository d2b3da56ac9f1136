"""Smoke tests of ``python -m recipes.main_ppo`` through the real entry point (issue 6).

Each run is a separate process with its own local Ray instance, 2 CPU worker slots, a tiny Qwen2
policy and a 2-step budget. A run's start (Ray, two workers importing vLLM, the engines) costs far
more than its steps, so each run checks several features at once: the suite stays under 25 minutes. A run passes when it finished, wrote a loadable HF checkpoint whose
weights moved, logged finite verl-named metrics for every step, and vLLM's sampling log-probs
agree with the actor's recomputation (the resharding check). Runs that must fail before Ray or
stop on the way are in test_main_ppo_stops.py.
"""
from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.recipes.conftest import run_main_ppo

STEPS, TEST_FREQ = 2, 2
VAL_SIZE = 8  # validation prompts in conftest's data set; val_kwargs.n=1
# What every run logs on every step; the values must be finite numbers.
STEP_METRICS = ("critic/score/mean", "critic/advantages/max", "response_length/mean", "actor/pg_loss",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "timing_s/gen",
                "timing_s/step", "perf/throughput", "training/rollout_probs_diff_max",
                "training/rollout_probs_diff_mean")
# the console as a user sees it, whatever the environment running the tests asks for
QUIET = {"HYBRIDFLOW_VERBOSE": "", "VERL_LOGGING_LEVEL": ""}
# fp32 everywhere: vLLM and the training engine compute the same probabilities up to rounding.
PROBS_DIFF_TOL = 1e-3


def _read_metrics(out_dir: str) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            assert row["step"] not in by_step, f"step {row['step']} logged twice"
            by_step[row["step"]] = row
    return by_step


def _read_dump(folder: str, steps) -> dict[int, list[dict]]:
    """``<folder>/<step>.jsonl`` for exactly ``steps``, each row with verl's fields."""
    assert sorted(os.listdir(folder)) == sorted(f"{step}.jsonl" for step in steps), os.listdir(folder)
    by_step = {}
    for step in steps:
        with open(os.path.join(folder, f"{step}.jsonl")) as f:
            by_step[step] = [json.loads(line) for line in f]
        for row in by_step[step]:
            assert {"input", "output", "gts", "score", "step", "data_source"} <= set(row), row
            assert row["step"] == step and row["input"].endswith("="), row
    return by_step


def _changed_tensors(initial_dir: str, trained_dir: str) -> list[str]:
    """Names of the HF tensors that differ; also checks both checkpoints load with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(initial_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).state_dict()
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].shape == after[name].shape, name
        assert torch.isfinite(after[name]).all(), f"{name} is not finite after training"
    return [name for name in before if not torch.equal(before[name], after[name])]


def check_quiet_console(result, out_dir: str) -> None:
    """vLLM's and Ray's INFO lines and the workers' own output are in the run's log folder, one
    file per rank, not on the console (hybridflow/run_logs.py); the last line names the folder."""
    console = result.stdout + result.stderr
    assert not re.search(r"\bINFO\b", console), console[-3000:]
    logs = os.path.join(out_dir, "logs")
    ranks = sorted(name for name in os.listdir(logs) if "_rank" in name)
    assert ranks == ["main_rank0.log", "main_rank1.log"], os.listdir(logs)
    for name in ranks:
        with open(os.path.join(logs, name)) as f:
            text = f.read()
        assert "INFO vllm.v1.engine.core: Initializing a V1 LLM engine" in text, text[-3000:]
    assert result.stdout.rstrip().endswith(f"; full logs in {os.path.abspath(logs)}"), result.stdout[-1000:]


def check_stage_timeline(out_dir: str, metrics: dict[int, dict], pools: dict[str, int]) -> None:
    """trainer.timeline's files: a Chrome trace with one track per worker of each pool and the
    driver's, spans disjoint within a track, the PPO stages named; the Gantt PNG; idle_frac per pool."""
    with open(os.path.join(out_dir, "timeline.json")) as f:
        events = json.load(f)["traceEvents"]
    pool_of = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    expected = {f"{pool} rank {r}" for pool, n in pools.items() for r in range(n)}
    assert set(tracks.values()) == expected | {"driver", "steps"}, tracks
    assert all(pool_of[pid] == name.split(" rank ")[0] for (pid, _), name in tracks.items() if " rank " in name)
    stages = {}
    for key, name in tracks.items():
        spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                       if e["ph"] == "X" and (e["pid"], e["tid"]) == key)
        assert all(a[1] <= b[0] + 1 for a, b in zip(spans, spans[1:])), (name, spans)  # microseconds, rounded
        stages[name] = {stage for _, _, stage in spans}
    assert {"generate_sequences", "update_actor", "compute_log_prob", "weight_sync",
            "validation"} <= stages["main rank 0"], stages
    assert {"compute_ref_log_prob", "compute_values", "update_critic"} <= stages["side rank 0"]
    assert "compute_rm_score" in stages["reward rank 0"] and "adv" in stages["driver"], stages
    assert os.path.getsize(os.path.join(out_dir, "timeline.png")) > 0
    for step in range(1, STEPS + 1):
        assert all(0.0 <= metrics[step][f"perf/idle_frac/{pool}"] <= 1.0 for pool in pools), metrics[step]


def check_run(result, out_dir: str, initial_model: str, extra_metrics: tuple[str, ...] = (),
              critic_warmup: int = 0, probs_diff_tol: float = PROBS_DIFF_TOL) -> dict[int, dict]:
    """The assertions every successful recipe run must satisfy; returns the metrics by step.
    Before step ``critic_warmup`` (verl's count: k - 1 critic-only steps) the actor is not
    updated, so it logs no ``actor/`` metric."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-6000:]}"
    assert os.path.getsize(os.path.join(out_dir, "reward_curve.png")) > 0
    metrics = _read_metrics(out_dir)
    assert sorted(metrics) == list(range(STEPS + 1)), sorted(metrics)  # step 0 = validation before training
    assert math.isfinite(metrics[0]["val/score/mean"])
    for step in range(1, STEPS + 1):
        row = metrics[step]
        if step < critic_warmup:
            assert not [key for key in row if key.startswith("actor/")], (step, sorted(row))
        for key in STEP_METRICS + extra_metrics:
            if step < critic_warmup and key.startswith("actor/"):
                continue
            assert key in row, f"step {step}: {key} missing from metrics.jsonl"
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), f"step {step}: {key}={row[key]}"
        assert row["training/rollout_probs_diff_max"] < probs_diff_tol, row["training/rollout_probs_diff_max"]
        assert row["response_length/mean"] > 0
        assert row["perf/throughput"] > 0
        assert ("val/score/mean" in row) == (step % TEST_FREQ == 0 or step == STEPS), step
    # The graded reward must have produced a learning signal, else "parameters changed" is moot.
    assert any(metrics[s]["critic/advantages/max"] > 0 for s in range(1, STEPS + 1))
    changed = _changed_tensors(initial_model, os.path.join(out_dir, "hf"))
    assert changed, "training did not change any weight of the exported HF checkpoint"
    return metrics


@pytest.mark.slow
def test_grpo_fsdp_in_bf16_where_param_dtype_auto_picks_it(recipe_assets, tmp_path):
    """GRPO with a sharded actor and a replicated reference, at the default param_dtype=auto on a
    machine with fast bf16 matmuls (the environment stands in for the probe): the actor (FSDP2
    mixed precision), its reference and vLLM all compute in bf16, the exported checkpoint holds the
    fp32 master weights. Also: verl's generation dumps, validation samples, Ray's timeline, a quiet
    console (vLLM's and Ray's lines in the run's log folder), and a val_only run of the export
    that reproduces the last validation."""
    import torch
    from safetensors import safe_open

    out = str(tmp_path / "run")
    bf16 = {"HYBRIDFLOW_AUTO_DTYPE": "bf16", **QUIET}
    result = run_main_ppo("grpo", recipe_assets.overrides(out) + [
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        # 2 mini-batches per step: the second is off-policy, so clipping and ppo_kl are exercised
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        # a replicated reference next to a sharded actor (auto would replicate both at this size)
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "actor_rollout_ref.ref.fsdp_config.fsdp_size=1",
        "trainer.log_val_generations=3", f"trainer.rollout_data_dir={out}/rollout",
        f"trainer.validation_data_dir={out}/validation", f"ray_kwargs.timeline_json_file={out}/timeline.json"],
        env=bf16)
    assert "param_dtype=auto -> bf16" in result.stderr, result.stderr[-3000:]
    check_quiet_console(result, out)
    # bf16 rounds each probability to ~3 significant digits, and vLLM's kernels round elsewhere
    # than the trainer's: measured 0.001-0.006 on tiny models, 0.05-0.09 on a 25M one
    metrics = check_run(result, out, recipe_assets.model, extra_metrics=(
        "actor/kl_loss", "timing_s/dump_rollout", "perf/gen_tail_share"), probs_diff_tol=0.05)
    assert all(0.0 <= metrics[s]["perf/gen_tail_share"] <= 1.0 for s in range(1, STEPS + 1))  # from each rollout rank
    assert metrics[STEPS]["training/rollout_probs_diff_max"] > 1e-5, metrics  # fp32 agrees to ~1e-7
    with safe_open(os.path.join(out, "hf", "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.float32}
    assert metrics[1]["actor/ppo_kl"] != 0.0
    # 3 validation samples as text at each validation (before training and at the last step)
    with open(os.path.join(out, "val_generations.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [0, 0, 0, STEPS, STEPS, STEPS]
    assert [s["input"] for s in samples[:3]] == [s["input"] for s in samples[3:]]  # the same prompts
    assert all(s["input"].endswith("=") and 0.0 <= s["score"] <= 1.0 for s in samples), samples
    # verl's generation dumps: every sequence of each step (4 prompts x n=2), every validation sample
    rollout = _read_dump(os.path.join(out, "rollout"), range(1, STEPS + 1))
    validation = _read_dump(os.path.join(out, "validation"), (0, STEPS))
    for step, rows in rollout.items():
        assert len(rows) == 4 * 2, (step, len(rows))
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(metrics[step]["critic/score/mean"], abs=1e-6)
    for step, rows in validation.items():
        assert len(rows) == VAL_SIZE, (step, len(rows))
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(metrics[step]["val/score/mean"], abs=1e-6)
        assert metrics[step]["val/reward_errors"] == 0.0
    assert validation[0][:3] == samples[:3]  # one set of rows serves both files
    with open(os.path.join(out, "timeline.json")) as f:  # Ray's Chrome trace of the run
        traced = {event.get("name", "") for event in json.load(f)}
    assert any("generate_sequences" in name for name in traced) and any("update_actor" in name for name in traced)

    # trainer.val_only on the exported model: greedy validation reproduces the last one, no training
    evaluation = str(tmp_path / "val_only")
    result = run_main_ppo("grpo", recipe_assets.overrides(evaluation) + [
        f"actor_rollout_ref.model.path={out}/hf", "trainer.val_only=true", "trainer.val_before_train=false"],
        env=bf16)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "done: validation only, at step 0" in result.stdout
    assert list(_read_metrics(evaluation)) == [0] and not os.path.exists(os.path.join(evaluation, "hf"))
    assert _read_metrics(evaluation)[0]["val/score/mean"] == metrics[STEPS]["val/score/mean"]


@pytest.mark.slow
def test_ppo_with_critic_gae_megatron_tp2_actor_and_reward_model(recipe_assets, tmp_path):
    """PPO with a critic: the actor trains with Megatron TP=2 and generates with vLLM TP=2 (weights
    resharded between them); the scores come from the sequence-classification reward model
    instead of a function; the critic in the replicated layout (fsdp_size=1: DDP, no sharding);
    one critic warm-up step (trainer.critic_warmup=2, as verl counts); verl's deprecated global
    critic.ppo_micro_batch_size (4 over 2 workers: 2 per worker); the step-2 checkpoint holds the
    value model as an HF checkpoint (checkpoint.save_contents hf_model)."""
    from transformers import AutoModelForTokenClassification

    out = str(tmp_path / "run")
    result = run_main_ppo("ppo", recipe_assets.overrides(out) + [
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size=4",
        "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "reward_model.enable=True", f"reward_model.model.path={recipe_assets.reward_model}",
        "critic.model.fsdp_config.fsdp_size=1", "trainer.critic_warmup=2", "trainer.save_freq=2",
        "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    assert "critic.ppo_micro_batch_size=4 is deprecated (verl): using critic.ppo_micro_batch_size_per_gpu=2" in result.stderr
    metrics = check_run(result, out, recipe_assets.model,
                        extra_metrics=("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean",
                                       "critic/vf_explained_var", "critic/rm_score/mean"), critic_warmup=2)
    # the RM's scores are the rewards (the digit-fraction function would give values in [0, 1])
    assert metrics[1]["critic/score/mean"] == pytest.approx(metrics[1]["critic/rm_score/mean"], abs=1e-5)
    # GAE advantages are whitened over the batch (mean 0), unlike GRPO's per-group ones
    assert abs(metrics[1]["critic/advantages/mean"]) < 1e-4
    value_model = AutoModelForTokenClassification.from_pretrained(f"{out}/global_step_2/critic/huggingface")
    assert value_model.config.num_labels == 1
    assert not os.path.exists(f"{out}/global_step_2/actor/huggingface/model.safetensors")  # the actor's default


@pytest.mark.slow
def test_dapo(recipe_assets, tmp_path):
    """The dapo recipe: dynamic sampling (6 prompts generated per batch, 4 kept whose samples
    differ), clip-higher, and the overlong penalty over the last 4 of 8 response tokens. Also
    verl's rollout correction (token TIS and token rejection) through the workers' loss, on a
    rollout that speculates (history drafts, the most every step): the sampler's log-probs are
    still the policy's."""
    out = str(tmp_path / "run")
    result = run_main_ppo("dapo", recipe_assets.overrides(out) + [
        "data.train_batch_size=4", "data.gen_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=5.0",
        "actor_rollout_ref.rollout.speculative.enable=true", "actor_rollout_ref.rollout.speculative.adaptive=false",
        "actor_rollout_ref.rollout.speculative.prompt_lookup_min=1"])
    metrics = check_run(result, out, recipe_assets.model,
                        extra_metrics=("filter_groups/num_gen_batches", "filter_groups/kept_prompts_frac",
                                       "rollout/spec_draft_tokens_per_step", "rollout/spec_acceptance_rate",
                                       "reward/overlong_penalty/mean", "reward/overlong/frac",
                                       "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction",
                                       "rollout_corr/kl"))
    for step in range(1, STEPS + 1):
        assert metrics[step]["critic/advantages/max"] > 0  # every kept prompt's samples differ
        assert metrics[step]["filter_groups/num_gen_batches"] >= 1
        # fp32 sampler and trainer agree to rounding: weights 1, nothing outside [0.2, 5] rejected
        assert metrics[step]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-2)
        assert metrics[step]["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert max(metrics[s]["rollout/spec_draft_tokens_per_step"] for s in range(1, STEPS + 1)) > 0  # drafts verified


@pytest.mark.slow
def test_remax(recipe_assets, tmp_path):
    """Also: batches that do not split evenly over the 2 generation workers (3 prompts, and
    validation in batches of 3 with 2 sampled responses each) come back with the right rows; a
    verl-style logger list without jsonl still writes metrics.jsonl and the reward curve; token-
    budget micro-batches (use_dynamic_bsz)."""
    out = str(tmp_path / "run")
    result = run_main_ppo("remax", recipe_assets.overrides(out) + [
        "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "data.val_batch_size=3", "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.logger=[console]",
        # micro-batches by token budget (verl's use_dynamic_bsz) in the update and the log-prob passes
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
        # LoRA on the sharded actor, a large lr: vLLM must get the merged weights (else the run
        # fails), the reference is the actor with its adapters off (KL 0 at step 1, not at step 2)
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"])
    metrics = check_run(result, out, recipe_assets.model,
                        extra_metrics=("timing_s/gen_max", "actor/reward_kl_penalty", "timing_s/ref"))
    # step 1 samples from the reference weights (KL exactly 0); after one update the k1 estimate
    # of KL(actor || ref) on the samples is non-zero (its sign is noise on 6 samples)
    assert metrics[1]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[2]["actor/reward_kl_penalty"] != 0.0
    # 2 sampled answers per validation prompt, in batches that split prompts 3 + 3 + 2: per-prompt
    # statistics (verl's mean@N / best@N) over groups the batching did not tear apart
    val = metrics[max(metrics)]
    assert val["val/score/worst@2"] <= val["val/score/mean@2"] <= val["val/score/best@2"]
    assert val["val/score/mean@2"] == pytest.approx(val["val/score/mean"])


@pytest.mark.slow
def test_separate_placement_ref_critic_reward_model(recipe_assets, tmp_path):
    """Actor+rollout on the main pool (2 slots); reference and critic on a second pool (1 slot);
    the reward model on that pool too, or (verl's reward_model.enable_resource_pool) on a third of
    its own. Up to 4 workers x 0.5 CPU fit this 2-core machine. The other pools work while the
    actor's does (reward model, reference and values during the old log-probs; the critic's update
    during the actor's); one stage after the other, on two pools, must give the same run. The
    overlapped run also writes its stage timeline (trainer.timeline), one track per worker of each pool."""
    runs = {}
    for overlap, reward_pool in (("true", ["reward_model.enable_resource_pool=true", "reward_model.nnodes=1",
                                           "reward_model.n_gpus_per_node=1", "trainer.timeline=true"]),
                                 ("false", [])):
        out = str(tmp_path / f"overlap-{overlap}")
        result = run_main_ppo("ppo", recipe_assets.overrides(out) + reward_pool + [
            "trainer.placement=separate", "trainer.separate_pool_gpus_per_node=1", "trainer.cpus_per_worker=0.5",
            f"trainer.overlap_separate_pools={overlap}",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "reward_model.enable=True", f"reward_model.model.path={recipe_assets.reward_model}"])
        runs[overlap] = check_run(result, out, recipe_assets.model,
                                  extra_metrics=("critic/vf_loss", "actor/kl_loss", "timing_s/ref",
                                                 "critic/rm_score/mean", "timing_s/update_critic"))
        # the pools' actor classes ran: Ray names each actor in the output its process wrote, which a
        # quiet run keeps in <run>/logs/
        pools = ["Colocated_ref_critic", "Colocated_reward_model"] if reward_pool else [
            "Colocated_ref_critic_reward_model"]
        logs = os.path.join(out, "logs")
        written = "".join(open(os.path.join(logs, name), errors="replace").read() for name in os.listdir(logs))
        assert all(f":actor_name:{name}" in written for name in pools), (pools, os.listdir(logs))
        if reward_pool:
            check_stage_timeline(out, runs[overlap], {"main": 2, "side": 1, "reward": 1})

    def untimed(metrics):
        return {step: {k: v for k, v in row.items() if not (k.startswith(("timing_s/", "perf/")) or k.endswith("_s"))}
                for step, row in metrics.items()}

    assert untimed(runs["true"]) == untimed(runs["false"])
    import torch
    from safetensors.torch import load_file

    weights = [load_file(os.path.join(tmp_path, f"overlap-{o}", "hf", "model.safetensors")) for o in ("true", "false")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_custom_chat_template_templates_every_prompt(recipe_assets, tmp_path):
    """actor_rollout_ref.model.custom_chat_template replaces the tokenizer's template before the
    prompts are tokenized (the tiny tokenizer has none: without it the contents are joined)."""
    from hybridflow.data import encode_prompt
    from recipes.main_ppo import load_and_validate, read_inputs

    template = "{% for m in messages %}={{ m.content }}{% endfor %}{% if add_generation_prompt %}+{% endif %}"
    args = ["--config-name", "grpo", *recipe_assets.overrides(str(tmp_path / "run"))]
    plain = read_inputs(load_and_validate(args)).train_loader.dataset
    templated = read_inputs(load_and_validate(args + [f"actor_rollout_ref.model.custom_chat_template='{template}'"]))
    ds = templated.train_loader.dataset
    assert templated.tokenizer.chat_template == template
    row = ds[0]
    ids = row["input_ids"][row["attention_mask"].bool()].tolist()
    assert ids == encode_prompt(templated.tokenizer, row["raw_prompt"])
    assert ids != plain.prompt_ids(0) and len(ids) == len(plain.prompt_ids(0)) + 2
