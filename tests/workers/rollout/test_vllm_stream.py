"""Streaming generation with tail migration (workers/rollout/vllm_stream.py) on real vLLM engines.

One spawned 1-rank gloo world holds two TP=1 engines of one tiny fp32 model (two "ranks" of
generation in one process, as a move between two ranks would see them); every check runs there
once and the tests read its results. Greedy: the rows a session returns, sorted by row_index,
equal generate_sequences' batch (every column, tokens exactly, log-probs to 1e-5) with no move,
with a move to a session that is generating its own prompts, with a move to one that has none,
with a partial export (the samples with the fewest tokens) to an engine whose last session ended,
and with an export of only the samples not started yet;
stop tokens end rows early. Sampled with a move: each row's log-probs equal a transformers
forward of its tokens.
"""
import dataclasses
import os

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from tests.distributed import run_distributed
from tests.workers.rollout.common import PROMPT_LEN, RESPONSE_LEN, load_hf, make_checkpoints, make_prompts, reference_log_probs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODEL, N = "qwen2-tied", 2
STOPS = list(range(3, 40))  # lengths then range from 1 to max_tokens
TEXTS = ["12+3=", "hello world", "a", "What is 7*8?", "xyz", "9-4=", "hi", "the cat sat"]
GREEDY = dict(do_sample=False, n=1, stop_token_ids=STOPS[:20])  # vLLM: greedy is one sample per prompt
SAMPLED = dict(n=N, temperature=1.0, stop_token_ids=STOPS)


def _prompts(path: str, meta: dict, texts=TEXTS) -> DataProto:
    prompts = make_prompts(path, texts=texts, meta=dict(meta))
    prompts.batch["row_index"] = torch.arange(len(prompts), dtype=torch.int64) * meta["n"]
    return prompts


def _np(out: DataProto | None) -> dict | None:
    if out is None:
        return None
    return {**{k: v.numpy() for k, v in out.batch.items()}, **{f"nt:{k}": v for k, v in out.non_tensor_batch.items()}}


def _run(stream, max_steps: int, calls: int | None = None) -> list:
    """Step calls until nothing is left (or ``calls`` of them); the slices of rows they returned."""
    rows = []
    while stream.unfinished and (calls is None or len(rows) < calls):
        got, left, steps = stream.step(max_steps)
        assert steps <= max_steps and left == stream.unfinished
        rows.append(_np(got))
    return [r for r in rows if r is not None]


def _stream_worker(rank, world, path):
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout
    from workers.rollout.vllm_stream import VLLMStream, _generated

    config = RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.25, seed=0)
    a, b = VLLMRollout(config, path), VLLMRollout(config, path)
    # c runs 2 sequences at once under vLLM's priority policy: samples wait there for a place
    c = VLLMRollout(dataclasses.replace(config, max_num_seqs=2, vllm_engine_kwargs={"scheduling_policy": "priority"}),
                    path)
    res = {"reference": _np(a.generate_sequences(_prompts(path, GREEDY)))}

    # no move, slices of 3 steps
    s = VLLMStream(a)
    res["queued"] = s.start(_prompts(path, GREEDY))
    res["plain"] = _run(s, 3)
    res["plain_metrics"] = s.metrics()
    assert s.step(5)[1:] == (0, 0)  # nothing left: no step runs
    s.close()

    # a move to an engine generating its own prompts: a has the first half, b the second
    half = _prompts(path, GREEDY)
    sa, sb = VLLMStream(a), VLLMStream(b)
    sa.start(half[:4])
    sb.start(half[4:])
    res["busy"] = _run(sa, 2, calls=2) + _run(sb, 1, calls=3)
    partials = sa.export()
    res["exported"] = [(p.row_index, len(p.token_ids), p.tokens_left) for p in partials]
    assert sa.unfinished == 0 and sa.step(4) == (None, 0, 0)
    sb.adopt(partials)
    res["busy"] += _run(sb, 3)
    res["busy_metrics"] = (sa.metrics(), sb.metrics())
    sa.close(), sb.close()

    # a move to an empty session (started with no prompts), back from b to a
    sb = VLLMStream(b)
    sb.start(_prompts(path, GREEDY))
    res["empty"] = _run(sb, 2, calls=1)
    sa = VLLMStream(a)
    assert sa.start(None) == 0
    sa.adopt(sb.export())
    res["empty"] += _run(sa, 4)
    sa.close(), sb.close()

    # a partial export (sample reallocation): a holds samples of two ages and hands over the 3 with
    # the fewest tokens, going on with the rest; b's last session has ended, a new one adopts them
    full = _prompts(path, GREEDY)
    sb = VLLMStream(b)
    sb.start(_prompts(path, GREEDY)[:2])
    _run(sb, 4)  # to its end: b generated and closed before it adopts
    sb.close()
    sa = VLLMStream(a)
    sa.start(full[:4])
    res["partial"] = _run(sa, 3, calls=1)
    sa.start(full[4:])
    res["partial"] += _run(sa, 1, calls=1)
    states = a.llm.llm_engine.output_processor
    held = {s.row_index: len(states.request_states[states.external_req_ids[r][0]].detokenizer.output_token_ids)
            for r, s in sa._samples.items()}  # tokens so far of each unfinished sample
    res["partial_progress"] = sa.progress()  # what reallocation's estimate reads (the same, by row)
    partials = sa.export(3)
    res["partial_held"], res["partial_exported"] = held, [(p.row_index, len(p.token_ids)) for p in partials]
    res["partial_left"] = sa.unfinished
    sb = VLLMStream(b)
    sb.adopt(partials)
    res["adopted_progress"] = sb.progress()  # an adopted sample's tokens include those made on a
    res["partial"] += _run(sb, 2) + _run(sa, 2)
    sa.close(), sb.close()

    # only samples not started: a steps its first half once, then queues the second half, whose
    # samples hold no token until the next step; an unstarted-only export takes just those
    sa = VLLMStream(a)
    sa.start(full[:4])
    res["unstarted"] = _run(sa, 1, calls=1)
    sa.start(full[4:])
    res["unstarted_count"], held = sa.unstarted, sa.unfinished
    partials = sa.export(6, unstarted_only=True)
    res["unstarted_exported"] = [(p.row_index, len(p.token_ids)) for p in partials]
    res["unstarted_left"] = (held - sa.unfinished, sa.unstarted)
    sb = VLLMStream(b)
    sb.adopt(partials)
    res["unstarted"] += _run(sb, 3) + _run(sa, 3)
    sa.close(), sb.close()

    # adopted first: c runs rows 0-1 and queues 2-3, then adopts rows 4-5 (queued on a, never
    # started there); with first=True they take c's next places, else they wait behind 2-3
    res["first_order"] = {}
    for first in (True, False):
        sc, sa = VLLMStream(c), VLLMStream(a)
        sc.start(full[:4])
        order, rows = [], []
        while sc.unfinished:
            got, _, _ = sc.step(1)
            rows += [] if got is None else [_np(got)]
            if sc.adopted == 0:  # after c's first step
                sa.start(full[4:6])
                sc.adopt(sa.export(None, unstarted_only=True), first=first)
                sa.close()
            started = sorted({int(r) for part in rows for r in part["row_index"]}
                             | {s.row_index for r, s in sc._samples.items() if _generated(s, sc._state(r)) > 0})
            order += [r for r in started if r not in order]
        res["first_order"][first], res[f"first_rows_{first}"] = order, rows
        sc.close()
    probe = VLLMStream(a)
    try:
        probe.adopt([], first=True)
    except ValueError as e:
        res["first_on_fcfs"] = str(e)
    probe.close()

    # sampled, with a move in the middle
    sa, sb = VLLMStream(a), VLLMStream(b)
    sa.start(_prompts(path, SAMPLED))
    res["sampled"] = _run(sa, 1, calls=3)
    sb.adopt(sa.export())
    res["sampled"] += _run(sb, 2)
    sa.close(), sb.close()
    return res


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    path, _ = make_checkpoints(tmp_path_factory.mktemp("stream"), MODEL)
    return path, run_distributed(_stream_worker, 1, path, timeout_s=300)[0]


def _joined(parts: list[dict]) -> dict:
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(out["row_index"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def _assert_equals_reference(parts: list[dict], reference: dict):
    got = _joined(parts)
    assert sorted(got) == sorted(reference) + ["row_index"]
    np.testing.assert_array_equal(got["row_index"], np.arange(len(TEXTS)))
    for key, want in reference.items():
        if key == "rollout_log_probs":
            np.testing.assert_allclose(got[key], want, atol=1e-5, rtol=0)
        else:
            np.testing.assert_array_equal(got[key], want, err_msg=key)


@pytest.mark.slow
def test_stream_rows_equal_generate_sequences(spawned):
    _, res = spawned
    assert res["queued"] == len(TEXTS)
    assert len(res["plain"]) > 1  # rows came in several slices, not all at the end
    _assert_equals_reference(res["plain"], res["reference"])
    lengths = res["reference"]["response_mask"].sum(1)
    assert lengths.min() < RESPONSE_LEN  # stop tokens ended some rows early
    assert 0.0 <= res["plain_metrics"]["perf/gen_tail_share"] <= 1.0


@pytest.mark.slow
def test_move_to_a_generating_engine_changes_nothing(spawned):
    _, res = spawned
    assert res["exported"] and all(k > 0 for _, k, _ in res["exported"])  # moved mid-sample
    _assert_equals_reference(res["busy"], res["reference"])
    sent, took = res["busy_metrics"]
    assert sent["rollout/stream_exported"] == took["rollout/stream_adopted"] == len(res["exported"])


@pytest.mark.slow
def test_move_to_an_empty_session_changes_nothing(spawned):
    _, res = spawned
    _assert_equals_reference(res["empty"], res["reference"])


@pytest.mark.slow
def test_a_partial_export_moves_the_shortest_prefixes_and_changes_nothing(spawned):
    _, res = spawned
    held, exported = res["partial_held"], res["partial_exported"]
    assert len(exported) == 3 and res["partial_left"] == len(held) - 3  # the rest stayed on a
    want = sorted(held, key=lambda row: (held[row], row))[:3]  # fewest tokens, then lowest row
    assert [row for row, _ in exported] == sorted(want)
    assert len({held[row] for row in held}) > 1  # the samples held differed in age: the choice mattered
    assert all(tokens == held[row] for row, tokens in exported)
    # progress, which sample reallocation estimates remaining work from: each unfinished sample's
    # tokens so far on any engine and its max_tokens
    assert {row: tokens for row, tokens, _ in res["partial_progress"]} == held
    assert {cap for _, _, cap in res["partial_progress"] + res["adopted_progress"]} == {RESPONSE_LEN}
    assert sorted((row, tokens) for row, tokens, _ in res["adopted_progress"]) == exported
    _assert_equals_reference(res["partial"], res["reference"])


@pytest.mark.slow
def test_an_unstarted_only_export_moves_only_samples_with_no_token(spawned):
    _, res = spawned
    assert res["unstarted_count"] == 4  # the second half, queued after the first half's step
    assert res["unstarted_exported"] == [(row, 0) for row in range(4, 8)]  # 4 of the 6 asked: no more were unstarted
    assert res["unstarted_left"] == (4, 0)  # those 4 left the session; the first half's, all started, stayed
    _assert_equals_reference(res["unstarted"], res["reference"])


@pytest.mark.slow
def test_sampled_log_probs_after_a_move_match_transformers(spawned):
    path, res = spawned
    got = _joined(res["sampled"])
    np.testing.assert_array_equal(got["row_index"], np.arange(len(TEXTS) * N))
    batch = DataProto.from_dict({k: torch.from_numpy(v) for k, v in got.items() if not k.startswith("nt:")})
    torch.testing.assert_close(batch.batch["rollout_log_probs"], reference_log_probs(load_hf(path), batch),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
def test_adopted_first_starts_moved_samples_before_the_receivers_waiting_ones(spawned):
    _, res = spawned
    ahead, behind = res["first_order"][True], res["first_order"][False]
    assert ahead[:2] == behind[:2] == [0, 1]  # the 2 places c had
    assert set(ahead[2:4]) == {4, 5} and set(behind[2:4]) == {2, 3}
    for first in (True, False):
        got = _joined(res[f"first_rows_{first}"])
        np.testing.assert_array_equal(got["row_index"], np.arange(6))
        np.testing.assert_array_equal(got["responses"], res["reference"]["responses"][:6])
    assert "scheduling_policy='priority'" in res["first_on_fcfs"]
