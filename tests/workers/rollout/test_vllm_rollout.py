"""vLLM rollout as an SPMD program in a real 2-process gloo world, checked against transformers.

One engine per spawned world is reused for every check (engine start dominates the cost):
greedy equals the HF rollout; sampled log-probs equal a full HF forward, and the samples (each
timed as it finishes, perf/gen_tail_share) equal plain LLM.generate's from the same random state;
after update_weights (live weights and vLLM's full reload) both equal the *new* weights' (tied and
untied heads); ignore_eos runs past an EOS to the full length and do_sample=false in the config
is greedy, both as transformers does; the config's vLLM arguments (max_model_len, prefix
caching, log stats, engine_kwargs) reach the engine; bad settings fail with clear errors. One extra
engine per rank (TP=2) loads with load_format=dummy and, after one sync, generates exactly what the
auto engine did.
TP=1 runs as generation DP=2 (two engines, each generating its own share of the prompts).
"""
import dataclasses
import os

import pytest
import torch

from hybridflow.model_overrides import load_hf_config
from hybridflow.protocol import DataProto
from tests.distributed import run_distributed
from tests.workers.rollout.common import (MODELS, PROMPT_LEN, RESPONSE_LEN, assert_layout,
                                          load_hf, make_checkpoints, make_eos_first_checkpoint,
                                          make_prompts, reference_log_probs)
from workers.rollout.base import RolloutConfig
from workers.rollout.hf_rollout import HFRollout
from workers.rollout.kv_cache_size import auto_kv_cache_bytes

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# a fraction, while the environment says 1 (above): the config's exact size must win. The untied
# model takes the default (None): what max_num_seqs sequences of the context need, under 1 GiB.
KV_CACHE_GIB = {"qwen2-tied": 0.25, "llama-untied": None}
SAMPLE_STOPS = list(range(3, 40))  # with these, sampled lengths range from 1 to max_tokens
HF_CONFIG = RolloutConfig(name="hf", prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)


# vLLM's scheduler keys reach the engine: one prefill chunk per prompt, at most this many tokens
# per engine step (tokens must still equal transformers')
BATCHED_TOKENS = 320
# the config's vLLM arguments reach the engine: a context longer than prompt + response, an
# engine_kwargs entry passed through, and each model flips one of vLLM's switches
CONTEXT_LEN = PROMPT_LEN + RESPONSE_LEN + 6
PASSED_THROUGH = {"max_logprobs": 3}
SWITCHES = {"qwen2-tied": dict(enable_prefix_caching=False), "llama-untied": dict(disable_log_stats=False)}
DUMMY_MODEL, DUMMY_TP = "qwen2-tied", 2  # the auto engine the dummy-loaded one must reproduce


def _config(tp: int, live_weights: bool = True, model_name: str | None = None) -> RolloutConfig:
    return RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
                         tensor_model_parallel_size=tp, kv_cache_gib=KV_CACHE_GIB.get(model_name, 0.25), seed=0,
                         cpu_live_weights=live_weights, max_num_batched_tokens=BATCHED_TOKENS,
                         enable_chunked_prefill=False, max_model_len=CONTEXT_LEN,
                         vllm_engine_kwargs=PASSED_THROUGH, **SWITCHES.get(model_name, {}))


def _generate(rollout, share: DataProto, **meta) -> dict:
    share.meta_info = meta
    # numpy, not tensors: tensors cross the result queue as shared-memory handles that die with
    # this process
    return {k: v.numpy() for k, v in rollout.generate_sequences(share).batch.items()}


def _plain_generate(llm, token_lists, params):
    """What the rollout ran before it timed each sample: one ``LLM.generate`` call."""
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in token_lists], params, use_tqdm=False)
    return [sorted(out.outputs, key=lambda c: c.index) for out in outputs], 0.0


def _generate_and_replay(rollout, share: DataProto, **meta) -> tuple[dict, dict, dict]:
    """(the call's batch, the same call through plain ``LLM.generate`` from the same random state,
    the call's metrics). The replay puts the random state back as the call left it, so the calls
    after it draw what they drew without it (the dummy-loaded engine repeats them unreplayed)."""
    from unittest import mock

    from workers.rollout import vllm_rollout

    before = torch.get_rng_state()  # vLLM's CPU sampler draws its noise seeds from it
    share.meta_info = meta
    out = rollout.generate_sequences(share)
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    with mock.patch.object(vllm_rollout, "generate_per_sample", side_effect=_plain_generate) as plain:
        replay = _generate(rollout, share, **meta)
    assert plain.call_count == 1  # the replay did run through LLM.generate
    torch.set_rng_state(after)
    return {k: v.numpy() for k, v in out.batch.items()}, replay, out.meta_info["metrics"]


# the first calls on a fresh engine, in this order (the dummy-loaded engine repeats them)
FIRST_CALLS = {"greedy": dict(do_sample=False),
               "sample": dict(n=4, temperature=1.0, stop_token_ids=SAMPLE_STOPS),
               "sample_t07": dict(n=2, temperature=0.7)}


def _live_weights(tp: int, model_name: str) -> bool:
    """Each sync path on both models: live weights on tied TP2 and untied TP1, vLLM's full
    reload (with the tied head's re-tie) on the other two."""
    return (tp == 2) == MODELS[model_name]["tied"]


def _rollout_worker(rank, world, tp, models):
    """Runs on every rank: for each model (one engine each, engines coexist in the process),
    generate this dp rank's share under several settings, update the weights, generate again."""
    import logging

    from safetensors.torch import load_file

    from workers.rollout.vllm_rollout import VLLMRollout
    from workers.rollout.vllm_weight_sync import PER_SYNC_INFO_LOGGERS

    import glob

    from workers.rollout import vllm_rollout

    from hybridflow import shm_names

    world_shm = f"/dev/shm/hf{os.environ['MASTER_PORT']}e"
    # a live owner's segment (this process's tag): the sweep must keep it
    live_shm = f"/dev/shm/hflive{os.environ['MASTER_PORT']}-{shm_names.owner_tag()}-{rank}"

    def plant_stale_shm_segment():
        """What a run killed (kill -9) while vLLM's CPU TP group was joining leaves: a segment
        named after the world and engine, owned by a process now gone (start time 1: never a live
        one's). The engine's start removes it, whether or not this CPU has the shm kernels."""
        if tp == 2 and vllm_rollout._ENGINES_IN_PROCESS == 0 and os.path.isdir("/dev/shm"):
            dead = f"o{os.getpid()}x1"  # this pid, another start time: a reused pid of a dead run
            ordinal = vllm_rollout._ENGINES_IN_PROCESS + 1
            for path in (f"{world_shm}{ordinal}-{dead}-tp:0-[0-1]-cpushm_{rank}", live_shm):
                with open(path, "wb") as f:
                    f.write(bytes(64))

    results, engines = {}, []
    for name, (old_path, new_path, stop_first, eos_first_path) in models.items():
        errors = {}
        try:
            VLLMRollout(_config(3), old_path)
        except ValueError as e:
            errors["tp"] = str(e)
        plant_stale_shm_segment()
        rollout = VLLMRollout(_config(tp, _live_weights(tp, name), name), old_path)
        # keep every engine alive: an engine's teardown destroys vLLM's process-wide parallel
        # groups, which the next engine in this process shares
        engines.append(rollout)
        share = make_prompts(old_path).chunk(rollout.dp_size)[rollout.dp_rank]
        try:
            too_long = make_prompts(old_path, texts=["x" * (PROMPT_LEN + 3)], prompt_len=PROMPT_LEN + 3)
            rollout.generate_sequences(too_long)
        except ValueError as e:
            errors["prompt"] = str(e)

        def run(**meta):
            return _generate(rollout, share, **meta)

        result = {"layout": (rollout.dp_rank, rollout.dp_size, rollout.is_collect), "errors": errors}
        for key, meta in FIRST_CALLS.items():
            if key == "sample":  # n=4 with lengths from 1 to max_tokens: a tail to time
                result[key], result["sample_replay"], result["sample_metrics"] = _generate_and_replay(
                    rollout, share, **meta)
            else:
                result[key] = run(**meta)
        result["stop"] = run(do_sample=False, stop_token_ids=[stop_first], max_tokens=6)
        result["why_full_reload"] = rollout.why_full_reload
        result["on_cpu"] = not rollout._on_gpu
        vllm_config = rollout.llm.llm_engine.vllm_config
        cache = vllm_config.cache_config
        result["kv_cache_bytes"] = cache.kv_cache_memory_bytes
        result["kv_cache_blocks"] = (cache.num_gpu_blocks, cache.block_size)
        scheduler = vllm_config.scheduler_config
        result["scheduler"] = (scheduler.max_num_batched_tokens, scheduler.enable_chunked_prefill)
        result["engine"] = dict(max_model_len=vllm_config.model_config.max_model_len,
                                max_logprobs=vllm_config.model_config.max_logprobs,
                                enable_prefix_caching=vllm_config.cache_config.enable_prefix_caching,
                                log_stats=rollout.llm.llm_engine.log_stats,
                                load_format=vllm_config.load_config.load_format)
        result["quiet_syncs"] = [not logging.getLogger(name).isEnabledFor(logging.INFO)
                                 for name in PER_SYNC_INFO_LOGGERS]
        rollout.update_weights(load_file(f"{new_path}/model.safetensors").items())
        result["greedy_new"] = run(do_sample=False)
        result["sample_new"] = run(n=4, temperature=1.0)
        # weights whose greedy response to one prompt starts with EOS: stop there, or run past it
        rollout.update_weights(load_file(f"{eos_first_path}/model.safetensors").items())
        result["eos_first"] = run(do_sample=False)
        result["ignore_eos"] = run(do_sample=False, ignore_eos=True)
        # the same two settings from the config (the trainer's training rollouts pass neither)
        rollout.config = dataclasses.replace(rollout.config, do_sample=False, ignore_eos=True)
        result["config_greedy_ignore_eos"] = run()
        results[name] = result
        # every rank has unlinked its segments once the group joined them; nothing stays behind
        result["shm_left"] = sorted(glob.glob(f"{world_shm}*"))  # planted or vLLM's
        result["owner_tag"] = shm_names.owner_tag()
        result["live_kept"] = os.path.exists(live_shm) if tp == 2 else True
        from vllm.distributed import parallel_state  # the TP group's broadcast ring (TP>1)

        ring = getattr(parallel_state.get_tp_group().mq_broadcaster, "buffer", None)
        result["shm_left"] += [ring.shared_memory.name] if ring and os.path.exists(
            f"/dev/shm/{ring.shared_memory.name}") else []
    if tp == DUMMY_TP and DUMMY_MODEL in models:
        # random weights, then the sync the hybrid worker does before its first generation
        old_path = models[DUMMY_MODEL][0]
        config = dataclasses.replace(_config(tp, _live_weights(tp, DUMMY_MODEL), DUMMY_MODEL), load_format="dummy")
        dummy = VLLMRollout(config, old_path)
        engines.append(dummy)
        dummy.update_weights(load_file(f"{old_path}/model.safetensors").items())
        share = make_prompts(old_path).chunk(dummy.dp_size)[dummy.dp_rank]
        results[DUMMY_MODEL]["dummy"] = {key: _generate(dummy, share, **meta) for key, meta in FIRST_CALLS.items()}
        results[DUMMY_MODEL]["dummy_load_format"] = dummy.llm.llm_engine.vllm_config.load_config.load_format
    if os.path.exists(live_shm):
        os.unlink(live_shm)
    return results


def _gather(results, key, prompts: DataProto, n: int = 1) -> DataProto:
    """Concatenate the collect ranks' outputs in dp order (what the controller does)."""
    parts = sorted((r["layout"][0], r[key]) for r in results if r["layout"][2])
    tensors = {k: torch.cat([torch.from_numpy(p[k]) for _, p in parts]) for k in parts[0][1]}
    uids = [u for u in prompts.non_tensor_batch["uid"] for _ in range(n)]
    return DataProto.from_dict(tensors, {"uid": uids})


# Which models share one spawned world: both, so each world builds two engines one after another
# (engine start dominates the cost) and checks they do not interfere.
SPAWN_GROUPS = {1: [tuple(MODELS)], 2: [tuple(MODELS)]}


@pytest.fixture(scope="module")
def spawn_cache(tmp_path_factory):
    return {"root": tmp_path_factory.mktemp("vllm_rollout")}


def _spawned(cache, tp: int, model_name: str):
    """((old, new, stop_first), per-rank results) of a model, spawning its group's world once."""
    group = next(g for g in SPAWN_GROUPS[tp] if model_name in g)
    if (tp, group) not in cache:
        models = {}
        for name in group:
            old_path, new_path = make_checkpoints(cache["root"] / f"tp{tp}", name)
            hf = HFRollout(load_hf(old_path), HF_CONFIG)
            greedy = hf.generate_sequences(make_prompts(old_path, meta={"do_sample": False}))
            eos_first_path, _ = make_eos_first_checkpoint(old_path, str(cache["root"] / f"tp{tp}" / f"{name}-eos"),
                                                          greedy, hf.eos_token_ids[0])
            models[name] = (old_path, new_path, int(greedy.batch["responses"][0, 0]), eos_first_path)
        per_rank = run_distributed(_rollout_worker, 2, tp, models, timeout_s=500)
        # the ranks have exited: no name they own (rank 0's tag) may be left in /dev/shm
        tags = {r[name]["owner_tag"] for r in per_rank for name in group}
        left = sorted(n for n in os.listdir("/dev/shm") if any(t in n for t in tags)) if os.path.isdir("/dev/shm") else []
        for r in per_rank:
            for name in group:
                r[name]["shm_left_after_exit"] = left
        cache[(tp, group)] = {name: (models[name], [r[name] for r in per_rank]) for name in group}
    return cache[(tp, group)][model_name]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1-dp2", "tp2-dp1"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_vllm_rollout_matches_transformers(spawn_cache, model_name, tp):
    (old_path, new_path, stop_first, _), results = _spawned(spawn_cache, tp, model_name)
    hf_old, hf_new = load_hf(old_path), load_hf(new_path)
    config = HF_CONFIG
    hf = HFRollout(hf_old, config)
    prompts = make_prompts(old_path, meta={"do_sample": False})
    hf_greedy = hf.generate_sequences(prompts)

    assert [r["layout"] for r in results] == [(rank // tp, 2 // tp, rank % tp == 0) for rank in range(2)]
    for r in results:
        live = _live_weights(tp, model_name)
        assert r["why_full_reload"] == (None if live else "rollout.cpu_live_weights=false")
        if r["on_cpu"] and KV_CACHE_GIB[model_name] is not None:
            assert r["kv_cache_bytes"] == int(KV_CACHE_GIB[model_name] * 2**30)
        elif r["on_cpu"]:  # the default: a full batch of whole contexts fits at once, in far less than 1 GiB
            config = _config(tp, model_name=model_name)
            assert r["kv_cache_bytes"] == auto_kv_cache_bytes(load_hf_config(old_path, {}), "float32",
                                                              config.max_num_seqs, CONTEXT_LEN) < 2**28
            blocks, block_size = r["kv_cache_blocks"]
            assert blocks >= config.max_num_seqs * -(-CONTEXT_LEN // block_size)
        assert r["scheduler"] == (BATCHED_TOKENS, False)
        assert r["engine"] == dict(max_model_len=CONTEXT_LEN, max_logprobs=3, load_format="auto",
                                   enable_prefix_caching=model_name != "qwen2-tied",
                                   log_stats=model_name == "llama-untied")
        assert all(r["quiet_syncs"])  # no INFO line per weight sync, even after the engine's build
        assert "tensor_model_parallel_size=3 must divide" in r["errors"]["tp"]
        assert "rollout.prompt_length=12" in r["errors"]["prompt"]
        assert r["shm_left"] == []  # a dead run's segment is swept, the engine's own unlinked
        assert r["live_kept"] and r["shm_left_after_exit"] == []
    if tp == 2:  # both ranks of one TP group return the same tokens
        assert (results[0]["sample"]["responses"] == results[1]["sample"]["responses"]).all()
    eos, pad = hf.eos_token_ids, hf.pad_token_id

    greedy = _gather(results, "greedy", prompts)
    assert torch.equal(greedy.batch["input_ids"], hf_greedy.batch["input_ids"])
    assert torch.equal(greedy.batch["response_mask"], hf_greedy.batch["response_mask"])
    torch.testing.assert_close(greedy.batch["rollout_log_probs"], hf_greedy.batch["rollout_log_probs"],
                               atol=1e-4, rtol=0)

    stop = _gather(results, "stop", prompts)
    hf_stop = hf.generate_sequences(make_prompts(old_path, meta={
        "do_sample": False, "stop_token_ids": [stop_first], "max_tokens": 6}))
    assert torch.equal(stop.batch["input_ids"], hf_stop.batch["input_ids"])
    assert stop.batch["response_mask"][0].tolist() == [1] + [0] * (RESPONSE_LEN - 1)  # EOS first
    assert 6 in stop.batch["response_mask"].sum(1).tolist()  # cut at max_tokens

    sample = _gather(results, "sample", prompts, n=4)
    assert_layout(sample, prompts, 4, set(SAMPLE_STOPS) | set(eos), pad)
    for r in results:  # timing each sample changed no token or log-prob of LLM.generate's
        for column, replayed in r["sample_replay"].items():
            assert (r["sample"][column] == replayed).all(), column
        # lengths from 1 to max_tokens (seeded, so the same every run): the last sample ends after the median
        assert 0.0 < r["sample_metrics"]["perf/gen_tail_share"] <= 1.0
    lengths = sample.batch["response_mask"].sum(1)
    assert lengths.min() < RESPONSE_LEN and lengths.max() > 1
    torch.testing.assert_close(sample.batch["rollout_log_probs"], reference_log_probs(hf_old, sample),
                               atol=1e-4, rtol=0)
    t07 = _gather(results, "sample_t07", prompts, n=2)
    assert_layout(t07, prompts, 2, set(eos), pad)
    torch.testing.assert_close(t07.batch["rollout_log_probs"],
                               reference_log_probs(hf_old, t07, temperature=0.7), atol=1e-4, rtol=0)

    # after update_weights: the new weights' greedy text and log-probs (tied head re-tied)
    hf_greedy_new = HFRollout(hf_new, config).generate_sequences(prompts)
    greedy_new = _gather(results, "greedy_new", prompts)
    assert torch.equal(greedy_new.batch["input_ids"], hf_greedy_new.batch["input_ids"])
    sample_new = _gather(results, "sample_new", prompts, n=4)
    torch.testing.assert_close(sample_new.batch["rollout_log_probs"],
                               reference_log_probs(hf_new, sample_new), atol=1e-4, rtol=0)
    assert not torch.equal(greedy_new.batch["responses"], greedy.batch["responses"])


def test_tokenizer_less_engine_build_warnings_are_dropped_and_others_kept():
    import logging

    from workers.rollout.vllm_rollout import _NoTokenizerWarnings

    keep = _NoTokenizerWarnings().filter

    def record(msg, exc=None):
        exc_info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("vllm.renderers.base", logging.WARNING, "base.py", 380, msg, (), exc_info)

    no_tokenizer = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not keep(record("Chat template warmup failed", no_tokenizer))
    assert not keep(record("Using None for EOS token id because tokenizer is not initialized"))
    assert keep(record("Chat template warmup failed", RuntimeError("bad jinja")))  # a real failure
    assert keep(record("Using None for EOS token id"))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1-dp2", "tp2-dp1"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_ignore_eos_and_greedy_config_match_transformers(spawn_cache, model_name, tp):
    """Weights whose greedy response to one prompt starts with EOS: it stops there; with
    ignore_eos every response runs to the full length, past EOS, token for token as transformers."""
    (old_path, _, _, eos_first_path), results = _spawned(spawn_cache, tp, model_name)
    hf = HFRollout(load_hf(eos_first_path), HF_CONFIG)
    eos = hf.eos_token_ids[0]
    greedy = hf.generate_sequences(make_prompts(old_path, meta={"do_sample": False}))
    row = int((greedy.batch["response_mask"].sum(1) == 1).nonzero()[0])
    assert int(greedy.batch["responses"][row, 0]) == eos

    eos_first = _gather(results, "eos_first", make_prompts(old_path))
    assert torch.equal(eos_first.batch["input_ids"], greedy.batch["input_ids"])
    assert eos_first.batch["response_mask"][row].tolist() == [1] + [0] * (RESPONSE_LEN - 1)

    hf_ignore = hf.generate_sequences(make_prompts(old_path, meta={"do_sample": False, "ignore_eos": True}))
    for key in ("ignore_eos", "config_greedy_ignore_eos"):
        out = _gather(results, key, make_prompts(old_path))
        assert out.batch["response_mask"].all(), key  # every response has the full length
        assert int(out.batch["responses"][row, 0]) == eos, key  # ... and went on past its EOS
        assert torch.equal(out.batch["input_ids"], hf_ignore.batch["input_ids"]), key
        torch.testing.assert_close(out.batch["rollout_log_probs"], hf_ignore.batch["rollout_log_probs"],
                                   atol=1e-4, rtol=0)


@pytest.mark.slow
def test_dummy_load_then_one_sync_generates_what_auto_does(spawn_cache):
    """load_format=dummy starts from random weights; after the sync the hybrid worker makes before
    its first generation, that generation (greedy and sampled, same seed) is the auto engine's."""
    _, results = _spawned(spawn_cache, DUMMY_TP, DUMMY_MODEL)
    for r in results:
        assert r["dummy_load_format"] == "dummy"
        for key in FIRST_CALLS:
            for column, auto in r[key].items():
                assert (r["dummy"][key][column] == auto).all(), (key, column)
