"""Partial rollout (workers/rollout/vllm_partial.py) on a real vLLM engine in a spawned gloo world,
checked against transformers' log-probs of each version's weights.

Two ranks, as one TP=2 engine (the first rank's switch decision must reach the other rank) and as
two TP=1 engines (generation DP=2, each switching alone). Each engine runs, from one random state: the plain call; the call with a switch that never fires (the same batch); a call
that switches to new weights at its third step; a call that switches twice. Sampled with stop ids
so that lengths vary and some samples are still running at a switch.
"""
import os

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from tests.distributed import run_distributed
from tests.workers.rollout.common import (PROMPT_LEN, RESPONSE_LEN, assert_layout, load_hf,
                                          make_checkpoints, make_prompts, reference_log_probs)
from workers.rollout.vllm_partial import NONE, PARTIAL_SAMPLES, TOKEN_VERSIONS, WEIGHT_SWITCHES, switch_metrics

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODEL, N = "qwen2-tied", 4
META = dict(n=N, temperature=1.0, stop_token_ids=list(range(3, 40)))


class _ScriptedSwitch:
    """A switch offering the given (version, weights path) at given poll numbers (1-based), None
    otherwise; on a rank that follows its TP group's first rank, each call offers the next one."""

    def __init__(self, offers: dict[int, tuple[int, str]], follows: bool):
        self.offers, self.follows, self.calls = offers, follows, 0
        self.queue = [offers[k] for k in sorted(offers)]

    def __call__(self):
        from safetensors.torch import load_file

        self.calls += 1
        offer = self.queue.pop(0) if self.follows else self.offers.get(self.calls)
        if offer is None:
            return None
        version, path = offer
        return version, lambda: load_file(f"{path}/model.safetensors").items()


def _partial_worker(rank, world, tp, old_path, new_path):
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    config = RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
                           tensor_model_parallel_size=tp, kv_cache_gib=0.25, seed=0)
    rollout = VLLMRollout(config, old_path)
    share = make_prompts(old_path).chunk(rollout.dp_size)[rollout.dp_rank]
    follows = rank % tp != 0

    def run(**kw):
        share.meta_info = dict(META)
        out = rollout.generate_sequences(share, **kw)
        return {k: v.numpy() for k, v in out.batch.items()}, out.meta_info["metrics"]

    start = torch.get_rng_state()  # vLLM's CPU sampler draws its noise from it
    results = {"plain": run()}
    torch.set_rng_state(start)
    never = _ScriptedSwitch({}, follows)
    results["never"] = run(switch=never, version=0, poll_s=0.0)
    torch.set_rng_state(start)
    once = _ScriptedSwitch({3: (1, new_path)}, follows)
    results["once"] = run(switch=once, version=0, poll_s=0.0)
    twice = _ScriptedSwitch({2: (2, old_path), 3: (3, new_path)}, follows)
    results["twice"] = run(switch=twice, version=1, poll_s=0.0)
    rare = _ScriptedSwitch({}, follows)
    run(switch=rare, version=3, poll_s=30.0)
    results["calls"] = {"never": never.calls, "once": once.calls, "twice": twice.calls, "rare": rare.calls}
    results["follows"], results["tp"] = follows, tp
    results["layout"] = (rollout.dp_rank, rollout.is_collect)
    results["pad"], results["stops"] = rollout.pad_token_id, set(META["stop_token_ids"]) | set(rollout.eos_token_ids)
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1-dp2", "tp2-dp1"])
def spawned(request, tmp_path_factory):
    old_path, new_path = make_checkpoints(tmp_path_factory.mktemp("partial"), MODEL)
    return old_path, new_path, run_distributed(_partial_worker, 2, request.param, old_path, new_path, timeout_s=400)


def _batch(results: list, key: str, prompts: DataProto) -> DataProto:
    """The collect ranks' batches of one call in dp order (what the controller gathers)."""
    parts = sorted((r["layout"][0], r[key][0]) for r in results if r["layout"][1])
    uids = [u for u in prompts.non_tensor_batch["uid"] for _ in range(N)]
    return DataProto.from_dict({k: torch.from_numpy(np.concatenate([p[k] for _, p in parts])) for k in parts[0][1]},
                               {"uid": uids})


def _assert_log_probs_of_each_version(batch: DataProto, models: dict[int, torch.nn.Module]):
    versions = batch.batch[TOKEN_VERSIONS]
    for version, model in models.items():
        at = versions == version
        assert at.any(), version
        torch.testing.assert_close(batch.batch["rollout_log_probs"][at],
                                   reference_log_probs(model, batch)[at], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_switch_that_never_fires_changes_nothing(spawned):
    _, _, results = spawned
    for r in results:
        plain, plain_metrics = r["plain"]
        never, metrics = r["never"]
        for column, values in plain.items():
            assert np.array_equal(never[column], values), column
        mask = plain["response_mask"].astype(bool)
        assert (never[TOKEN_VERSIONS][mask] == 0).all() and (never[TOKEN_VERSIONS][~mask] == NONE).all()
        assert metrics[PARTIAL_SAMPLES] == 0 and metrics[WEIGHT_SWITCHES] == 0
        assert set(metrics) == set(plain_metrics) | {PARTIAL_SAMPLES, WEIGHT_SWITCHES}
    # with poll_s=0 the first rank polled before every step; the other rank never asked its switch
    assert [r["calls"]["never"] > 2 for r in results] == [not r["follows"] for r in results]
    assert all(r["calls"]["never"] == 0 for r in results if r["follows"])
    # with poll_s longer than the call: at its start (TP > 1: and once more, after the first step
    # gave the step time that spaces the exchanges)
    assert [r["calls"]["rare"] for r in results] == [0 if r["follows"] else 1 + (r["tp"] > 1) for r in results]


@pytest.mark.slow
def test_samples_go_on_with_the_new_weights_from_the_old_ones_prefix(spawned):
    old_path, new_path, results = spawned
    prompts = make_prompts(old_path)
    hf_old, hf_new = load_hf(old_path), load_hf(new_path)
    first = results[0]
    for r in results:  # the ranks of a TP group sampled the same tokens
        if r["follows"]:
            assert np.array_equal(r["once"][0]["responses"], first["once"][0]["responses"])
    plain, once = _batch(results, "plain", prompts), _batch(results, "once", prompts)
    assert_layout(once, prompts, N, first["stops"], first["pad"])

    versions = once.batch[TOKEN_VERSIONS]
    mask = once.batch["response_mask"].bool()
    assert ((versions >= 0) == mask).all()
    assert (versions[:, 1:][mask[:, 1:]] >= versions[:, :-1][mask[:, 1:]]).all()  # old weights, then new
    # the tokens before the switch are the unswitched call's (same random state, same steps)
    old = versions == 0
    assert old.any() and torch.equal(once.batch["responses"][old], plain.batch["responses"][old])
    # some samples were cut by the switch and went on; the metrics count them
    partial = _rows_of_several_versions(versions)
    assert partial > 0 and sum(r["once"][1][PARTIAL_SAMPLES] for r in results if r["layout"][1]) == partial
    assert all(r["once"][1][WEIGHT_SWITCHES] == 1 for r in results)
    _assert_log_probs_of_each_version(once, {0: hf_old, 1: hf_new})
    # ... which would fail with the old weights' log-probs after the switch
    new = versions == 1
    assert (reference_log_probs(hf_old, once)[new] - once.batch["rollout_log_probs"][new]).abs().max() > 1e-2
    # the other rank fetched its weights once, when its first rank switched
    assert all(r["calls"]["once"] == 1 for r in results if r["follows"])


@pytest.mark.slow
def test_two_switches_in_one_call(spawned):
    old_path, new_path, results = spawned
    prompts = make_prompts(old_path)
    twice = _batch(results, "twice", prompts)
    assert_layout(twice, prompts, N, results[0]["stops"], results[0]["pad"])
    assert all(r["twice"][1][WEIGHT_SWITCHES] == 2 for r in results)
    partial = sum(r["twice"][1][PARTIAL_SAMPLES] for r in results if r["layout"][1])
    assert partial == _rows_of_several_versions(twice.batch[TOKEN_VERSIONS])
    # it began on the new weights (the last call's), went back to the old ones, then to the new
    _assert_log_probs_of_each_version(twice, {1: load_hf(new_path), 2: load_hf(old_path), 3: load_hf(new_path)})
    assert all(r["calls"]["twice"] == 2 for r in results if r["follows"])


def _rows_of_several_versions(versions: torch.Tensor) -> int:
    return sum(len(set(row.tolist()) - {NONE}) > 1 for row in versions)


def test_switch_metrics_count_rows_written_by_more_than_one_version():
    class Switched:
        switches = 2

    versions = torch.tensor([[3, 3, -1], [2, 3, 3], [3, -1, -1], [1, 2, 3]])
    assert switch_metrics(versions, Switched()) == {PARTIAL_SAMPLES: 2.0, WEIGHT_SWITCHES: 2.0}
