"""Response log-prob / entropy helpers and batch helpers against hand computations."""
from __future__ import annotations

import math

import pytest
import torch

from hybridflow.protocol import DataProto
from workers.engines.base import (META_DP_SIZE, META_GLOBAL_NONEMPTY_ROWS, META_GLOBAL_ROWS, META_GLOBAL_TOKENS,
                                  META_MINI_BATCH_ROWS, active_span,
                                  mini_batch_token_mean, split_micro_batches)
from workers.engines.logprob import response_log_probs, response_logits


def test_log_prob_and_entropy_by_hand():
    # one position, vocabulary of 3, temperature 2: z = [2, 0, -2] / 2 = [1, 0, -1]
    logits = torch.tensor([[[2.0, 0.0, -2.0]]])
    lse = math.log(math.e + 1 + math.exp(-1))
    probs = [math.exp(z - lse) for z in (1.0, 0.0, -1.0)]
    log_probs, entropy = response_log_probs(logits, torch.tensor([[2]]), temperature=2.0, calculate_entropy=True)
    assert log_probs.item() == pytest.approx(-1.0 - lse, abs=1e-6)
    assert entropy.item() == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-6)
    _, none = response_log_probs(logits, torch.tensor([[0]]), temperature=1.0)
    assert none is None


def test_response_logits_use_position_before_each_token():
    # position i's logits are all equal to i, so the slice tells which positions were taken
    prompt_len, resp_len = 3, 2
    logits = torch.arange(prompt_len + resp_len, dtype=torch.float32).view(1, -1, 1).expand(1, -1, 4)
    taken = response_logits(logits, prompt_len, resp_len)[0, :, 0]
    assert taken.tolist() == [2.0, 3.0]  # token P+t is predicted at P+t-1
    with pytest.raises(ValueError, match="prompt_length"):
        response_logits(logits, 0, resp_len)


def test_zero_temperature_is_rejected():
    with pytest.raises(ValueError, match="temperature"):
        response_log_probs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)


def test_active_span_drops_all_padding_columns_only():
    #            prompt (P=4)   response (R=4)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0],
                         [0, 1, 1, 1, 1, 0, 0, 0]])
    assert active_span(mask, 4) == (1, 6)
    # a prompt that fills P keeps column 0; an empty response still keeps one response column
    assert active_span(torch.tensor([[1, 1, 1, 0, 0]]), 3) == (0, 4)


def test_micro_batches_and_token_mean_scaling():
    data = DataProto.from_dict({"x": torch.arange(5)}, meta_info={"temperature": 0.5})
    parts = split_micro_batches(data, 2)
    assert [len(p) for p in parts] == [2, 2, 1]
    parts[0].meta_info["extra"] = 1
    assert "extra" not in data.meta_info and "extra" not in parts[1].meta_info

    # 2 ranks x 4 rows, micro-batches of 2 rows: the scaled micro losses, weighted by m/M and
    # averaged over ranks as the engine and DP reduction do, must give the global token mean
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 6.0], [7.0, 8.0],
                           [1.0, 1.0], [2.0, 0.0], [4.0, 4.0], [9.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.float32)
    total = 0.0
    for rank in range(2):
        for micro in range(2):
            rows = slice(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2)
            batch = DataProto.from_dict({"v": values[rows]}, meta_info={
                META_DP_SIZE: 2, META_MINI_BATCH_ROWS: 4, META_GLOBAL_TOKENS: int(mask.sum()),
                META_GLOBAL_ROWS: 8, META_GLOBAL_NONEMPTY_ROWS: 8})
            total += mini_batch_token_mean(values[rows], mask[rows], batch).item() * (2 / 4) / 2
    assert total == pytest.approx(float((values * mask).sum() / mask.sum()))
    with pytest.raises(ValueError, match="meta_info lacks"):
        mini_batch_token_mean(values, mask, DataProto.from_dict({"v": values}))
