"""GenerationStream (hybridflow/controller/stream.py), the streaming primitive as a user's own
dataflow drives it: a real Ray group of two vLLM rollout workers, greedy.

Tail migration: chunks come back while others generate; after the first chunk the unfinished
samples move onto one rank; every row comes back once, and the batch equals the group's
generate_sequences, row for row. Sample reallocation: the prompts are dealt so that one rank gets
every long answer (ordered by their generate_sequences length); the stream moves samples between
the ranks once one holds far more unfinished samples than the other, and the batch is still
generate_sequences' own, as is the trainer's streamed generation's; by default only queued samples
move (the engines run 4 at once). Dealt by the answers' lengths
(``lengths=``, the trainer's ``deal_by_length``), the same lopsided batch gives each rank half of
the long answers."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

TEXTS = ["12+3=", "hello world", "a", "What is 7*8?", "xyz", "9-4=", "hi", "the cat sat", "b", "1+1="]
KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids")
# an engine runs 4 samples at once and queues the rest, as RL rollouts' engines do (reallocation
# moves queued samples by default)
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def group(ray_cluster, tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool, create_colocated_worker_cls
    from hybridflow.tiny import make_tiny_checkpoint
    from tests.workers.rollout.common import PROMPT_LEN, RESPONSE_LEN
    from workers.rollout.base import RolloutConfig
    from workers.rollout_worker import RolloutWorker, RolloutWorkerSettings

    ckpt = make_tiny_checkpoint(str(tmp_path_factory.mktemp("stream") / "model"), seed=0)
    settings = RolloutWorkerSettings(model_path=ckpt, rollout=RolloutConfig(
        prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.125, seed=0, dtype="float32",
        # as the recipe builds them with reallocation.adopted_first (moved samples start first)
        max_num_seqs=MAX_NUM_SEQS, vllm_engine_kwargs={"scheduling_policy": "priority"}))
    pool = ResourcePool([2], cpus_per_slot=1, name_prefix="stream", ready_timeout_s=60)
    workers = RayWorkerGroup(pool, create_colocated_worker_cls({"rollout": RayClassWithInitArgs(RolloutWorker, settings)}),
                             name_prefix="stream", timeout_s=240).spawn(["rollout"])["rollout"]
    try:
        workers.init_model()
        workers.ckpt = ckpt
        yield workers
    finally:
        workers.shutdown()
        pool.release()


def _assert_same_batch(got, want):
    for key in KEYS:
        torch.testing.assert_close(got.batch[key], want.batch[key], msg=key)
    torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_a_stream_is_the_generation_chunk_by_chunk_with_a_moved_tail(group):
    from hybridflow.controller.stream import ROW_INDEX, GenerationStream
    from tests.workers.rollout.common import make_prompts

    prompts = make_prompts(group.ckpt, texts=TEXTS, meta=dict(do_sample=False, n=1, stop_token_ids=list(range(3, 23))))
    want = group.generate_sequences(prompts)

    stream = GenerationStream(group, prompts, slice_s=1e-4)  # n from meta_info; one-step slices
    chunks, moved = [], 0
    for chunk in stream:
        chunks.append(chunk)
        if not moved:
            chunks += stream.migrate(keep=1)  # what the leaving rank's queued slices finished
            moved = stream.moved
    got = stream.batch()
    assert moved > 0 and len(chunks) > 1 and stream.free_ranks()
    rows = torch.cat([c.batch[ROW_INDEX] for c in chunks])
    assert sorted(rows.tolist()) == list(range(len(TEXTS)))  # each row once
    _assert_same_batch(got, want)
    assert stream.metrics()["fusion/migrated_samples"] == moved
    assert "rollout/reallocated_samples" not in stream.metrics()  # reallocation is off by default
    with pytest.raises(ValueError, match="samples per prompt"):
        GenerationStream(group, prompts.select(meta_info_keys=[]))
    with pytest.raises(ValueError, match="rebalance=1"):
        GenerationStream(group, prompts, rebalance=1)
    with pytest.raises(ValueError, match="2 lengths for 10 prompts"):
        GenerationStream(group, prompts, lengths=[1.0, 2.0])


def _lopsided(group):
    """Prompts ordered longest answer first, so rank 0 (the first half of the rows) gets every
    long answer, and generate_sequences' batch of them."""
    from tests.workers.rollout.common import make_prompts

    texts = TEXTS * 2
    meta = dict(do_sample=False, n=1, stop_token_ids=list(range(3, 40)))  # 12 of the 20 answers stop within 2 tokens
    measured = group.generate_sequences(make_prompts(group.ckpt, texts=texts, meta=dict(meta)))
    lengths = measured.batch["response_mask"].sum(1)
    assert lengths.max() >= 3 * lengths.min()  # the deal is lopsided
    texts = [texts[i] for i in torch.argsort(-lengths, stable=True).tolist()]
    prompts = make_prompts(group.ckpt, texts=texts, meta=dict(meta))
    return prompts, group.generate_sequences(prompts)


@pytest.mark.parametrize("move_started", [False, True])
def test_reallocation_moves_samples_off_the_rank_dealt_the_long_ones(group, move_started):
    """By default only queued samples move (none had generated a token: nothing to recompute);
    ``move_started`` moves running ones too."""
    from hybridflow.controller.stream import REALLOCATED, REALLOCATED_TOKENS, REALLOCATIONS, GenerationStream

    prompts, want = _lopsided(group)
    stream = GenerationStream(group, prompts, slice_s=1e-4, rebalance=0.5, move_started=move_started)
    for _ in stream:
        pass
    _assert_same_batch(stream.batch(), want)
    metrics = stream.metrics()
    assert metrics[REALLOCATED] > 0 and metrics[REALLOCATIONS] >= 1, metrics
    if not move_started:
        assert metrics[REALLOCATED_TOKENS] == 0, metrics
    assert metrics[REALLOCATED] == stream.reallocated and stream.moved == 0  # not migrate's
    # what one rank exported the other adopted (a replica's sessions' counts add up). Which way
    # samples go is the ranks' pace: on 2 shared cores the rank dealt the short answers can lag
    # so far that the other one ran dry first
    adopted = [r.metrics.get("rollout/stream_adopted", 0.0) for r in stream.replicas]
    exported = [r.metrics.get("rollout/stream_exported", 0.0) for r in stream.replicas]
    assert sum(adopted) == sum(exported) == metrics[REALLOCATED], (adopted, exported, metrics)

    # the trainer's generation with reallocation.enable (hybridflow/trainer/reallocated_rollout.py):
    # generate_sequences' batch and meta_info, its per-rank metrics, and the moves
    from hybridflow.config.reallocation import ReallocationConfig
    from hybridflow.trainer.reallocated_rollout import generate

    got = generate(group, prompts, 1, ReallocationConfig(enable=True, threshold=0.5, slice_s=1e-4,
                                                         move_started=move_started))
    _assert_same_batch(got, want)
    assert sorted(got.batch.keys()) == sorted(want.batch.keys())
    got_metrics, want_metrics = got.meta_info.pop("metrics"), dict(want.meta_info.pop("metrics", {}))
    assert got.meta_info == want.meta_info
    assert set(want_metrics) <= set(got_metrics) and got_metrics[REALLOCATED] > 0, (got_metrics, want_metrics)


def test_dealt_by_answer_length_each_rank_gets_half_the_long_answers(group):
    """The same lopsided batch dealt by its answers' lengths (as the trainer does from an earlier
    epoch's): both ranks hold as many long answers, and the batch is still generate_sequences'."""
    from hybridflow.config.reallocation import ReallocationConfig
    from hybridflow.controller.stream import REALLOCATED, REALLOCATIONS, GenerationStream
    from hybridflow.trainer.reallocated_rollout import KNOWN, AnswerLengths, generate

    prompts, want = _lopsided(group)
    lengths = want.batch["response_mask"].sum(1)
    long_ = set(torch.nonzero(lengths > lengths.median()).flatten().tolist())
    assert long_ <= set(range(len(lengths) // 2))  # the plain split gives rank 0 every long answer

    stream = GenerationStream(group, prompts, slice_s=1e-4, lengths=lengths.tolist())
    for _ in stream:
        pass
    _assert_same_batch(stream.batch(), want)
    assert [len(long_ & set(share)) for share in stream.dealt] == [len(long_) // 2, len(long_) - len(long_) // 2]
    assert sorted(sum(stream.dealt, [])) == list(range(len(prompts)))

    # the trainer's: the first step records what the second deals by
    history, config = AnswerLengths(), ReallocationConfig(enable=True, threshold=0.5, slice_s=1e-4)
    for known in (0.0, 1.0):
        got = generate(group, prompts, 1, config, history)
        _assert_same_batch(got, want)
        assert got.meta_info["metrics"][KNOWN] == known
    # every prompt known: the deal balances the ranks, and no sample moves (rebalance_threshold)
    assert got.meta_info["metrics"][REALLOCATED] == got.meta_info["metrics"][REALLOCATIONS] == 0.0
    assert history.expected(prompts) == lengths.float().tolist()
