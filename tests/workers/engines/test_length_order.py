"""Micro-batches in length order (``group_by_length``, workers/engines/length_order.py): prompt
groups ordered by their longest row with their rows kept together, and on both engines the same
log-probs, values and training step as in batch order, for less padding computed."""
from __future__ import annotations

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch, policy_gradient_loss, value_loss
from workers.engines.base import active_span, split_micro_batches
from workers.engines.length_order import length_order, restore_order

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


def _both_orders(rank, world, ckpt, strategy, role):
    from workers.engines.config import EngineConfig

    # data-parallel ranks (FSDP) hold rows of their own; Megatron's TP peers hold the same rows
    seed = 11 + (rank if strategy == "fsdp" else 0)
    data = make_grouped_rl_batch(prompts=4, n=2, prompt_len=P, resp_len=R, vocab=VOCAB, seed=seed)
    data.meta_info["temperature"] = TEMP
    assert length_order(data) is not None  # the engines do reorder these rows
    out = {}
    for grouped in (False, True):
        kwargs = dict(strategy=strategy, micro_batch_size_per_gpu=2, lr=1e-3, group_by_length=grouped, seed=0)
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
