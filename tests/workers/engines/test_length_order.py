"""Micro-batches in length order (``group_by_length``, workers/engines/length_order.py): rows by
length with a prompt's equal-length samples together, taken only where that feeds the model fewer
positions (not for long prompts with short answers), and on both engines the same log-probs, values
and training step as in batch order, for less padding computed."""
from __future__ import annotations

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch, policy_gradient_loss, value_loss
from workers.engines.base import active_span, split_micro_batches
from workers.engines.token_budget import micro_batches
from workers.engines.length_order import in_length_order, length_order, padded_positions, restore_order

P, R, VOCAB, TEMP = 6, 12, 128, 0.7


def _ends(data) -> list[int]:
    mask = data.batch["attention_mask"]
    return (mask.shape[1] - mask.flip(-1).int().argmax(-1)).tolist()


def test_rows_go_by_length_and_equal_lengths_by_prompt():
    data = make_grouped_rl_batch(prompts=5, n=3, prompt_len=P, resp_len=R, vocab=VOCAB, seed=3)
    b = data.batch
    b["attention_mask"][[4, 9], P:] = b["attention_mask"][0, P:]  # rows 0, 4 and 9 as long as each other
    order = length_order(data)
    assert order is not None and sorted(order.tolist()) == list(range(15))
    ends = _ends(data)
    assert [ends[i] for i in order] == sorted(ends)
    tied = [i for i in order.tolist() if ends[i] == ends[0]]
    assert [i for i in tied if i in (0, 4, 9)] == [0, 4, 9]  # by prompt (0 and 4: prompts 0 and 1), then row
    values = torch.arange(15.0)[:, None].expand(15, 4)
    assert torch.equal(restore_order(order, values[order]), values)
    assert length_order(data[0:1]) is None
    single = make_grouped_rl_batch(prompts=8, n=1, prompt_len=P, resp_len=R, vocab=VOCAB, seed=6)
    assert length_order(single[length_order(single)]) is None  # already in order: nothing to do


def test_samples_of_one_length_keep_their_prompt_together():
    data = make_grouped_rl_batch(prompts=3, n=2, prompt_len=P, resp_len=R, vocab=VOCAB, seed=4)
    mask = data.batch["attention_mask"]
    mask[:, P:] = 0
    for row, length in enumerate((5, 2, 2, 5, 2, 2)):
        mask[row, P:P + length] = 1
    assert length_order(data).tolist() == [1, 2, 4, 5, 0, 3]


def test_length_order_cuts_the_padding_micro_batches_compute():
    data = make_grouped_rl_batch(prompts=16, n=1, prompt_len=P, resp_len=R, vocab=VOCAB, seed=5)

    def padded(d) -> int:
        spans = [active_span(m.batch["attention_mask"], P) for m in split_micro_batches(d, 4)]
        return sum(4 * (end - start) for start, end in spans)

    assert padded(data[length_order(data)]) < padded(data)
    # padded_positions counts what the engines feed: the last column is never an input
    assert padded_positions(data, None, 4, None, share=False) == padded(data) - 16


def _answer_lengths(data, lengths) -> None:
    """Give each prompt's samples (consecutive rows) the answer length ``lengths[prompt]``."""
    mask = data.batch["attention_mask"]
    n = len(data) // len(lengths)
    mask[:, P:] = 0
    for row in range(len(data)):
        mask[row, P:P + lengths[row // n]] = 1
    data.batch["response_mask"] = mask[:, P:].clone()


def test_the_order_is_taken_only_where_it_feeds_fewer_positions():
    # long and short answers alternate by prompt: length order pairs the short prompts
    data = make_grouped_rl_batch(prompts=4, n=2, prompt_len=P, resp_len=R, vocab=VOCAB, seed=7)
    _answer_lengths(data, (R, 2, R - 1, 3))
    ordered, order = in_length_order(data, True, 4, None, share=True)
    assert order is not None and padded_positions(data, order, 4, None, True) < padded_positions(data, None, 4, None, True)
    assert in_length_order(data, False, 4, None, share=True)[1] is None  # the key off
    # long prompts, short answers of every length within each prompt: sorting would split each
    # prompt's samples over micro-batches and run the prompt once in each
    data = make_grouped_rl_batch(prompts=8, n=4, prompt_len=200, resp_len=16, vocab=VOCAB, seed=1)
    assert length_order(data) is not None
    kept, order = in_length_order(data, True, 8, None, share=True)
    assert order is None and kept is data
    # token-budget micro-batches are counted as token_budget cuts them
    micros = micro_batches(data, 8, 1500)
    spans = [active_span(m.batch["attention_mask"], 200) for m in micros]
    assert {len(m) for m in micros} != {8} and padded_positions(data, None, 8, 1500, False) == \
        sum(len(m) * (end - 1 - start) for m, (start, end) in zip(micros, spans))


def _both_orders(rank, world, ckpt, strategy, role):
    from workers.engines.config import EngineConfig

    # data-parallel ranks (FSDP) hold rows of their own; Megatron's TP peers hold the same rows
    seed = 11 + (rank if strategy == "fsdp" else 0)
    data = make_grouped_rl_batch(prompts=4, n=2, prompt_len=P, resp_len=R, vocab=VOCAB, seed=seed)
    _answer_lengths(data, (3, R, 1, R) if seed == 12 else (R, 2, R - 1, 3))
    data.meta_info["temperature"] = TEMP
    assert in_length_order(data, True, 4, None, share=True)[1] is not None  # the engines do reorder these rows
    out = {}
    for grouped in (False, True):
        kwargs = dict(strategy=strategy, micro_batch_size_per_gpu=4, lr=1e-3, group_by_length=grouped, seed=0)
        if strategy == "megatron":
            kwargs.update(tp=world)
        if strategy == "fsdp":
            from workers.engines.fsdp import FSDPEngine as Engine
        else:
            from workers.engines.megatron import MegatronEngine as Engine
        engine = Engine(EngineConfig(**kwargs), ckpt, role)
        if role == "critic":
            first = engine.compute_values(data)
            step = engine.train_batch(data, value_loss)
            after = engine.compute_values(data)
        else:
            first, _ = engine.compute_log_prob(data, TEMP)
            step = engine.train_batch(data, policy_gradient_loss)
            after, _ = engine.compute_log_prob(data, TEMP)
        out[grouped] = (first, step, after)
        del engine
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy,role", [("fsdp", "actor"), ("fsdp", "critic"), ("megatron", "actor")])
def test_both_engines_compute_and_train_the_same_in_length_order(tmp_path, strategy, role):
    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), "qwen2", layers=2, seed=0)
    results = run_distributed(_both_orders, 2, ckpt, strategy, role)
    for rank_out in results:
        (plain, plain_step, plain_after), (grouped, grouped_step, grouped_after) = rank_out[False], rank_out[True]
        torch.testing.assert_close(grouped, plain, rtol=0, atol=5e-5)  # in the caller's row order
        torch.testing.assert_close(grouped_after, plain_after, rtol=0, atol=5e-5)  # the same step taken
        for key in plain_step:
            assert grouped_step[key] == pytest.approx(plain_step[key], rel=1e-5, abs=1e-6), key
