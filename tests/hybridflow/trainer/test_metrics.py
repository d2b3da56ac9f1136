"""The step's data metrics (hybridflow/trainer/metrics.py) on a batch worked out by hand."""
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import data_metrics


def _batch(response_lengths: list[int], response: int = 8, prompt: int = 4) -> DataProto:
    rows = len(response_lengths)
    mask = torch.zeros(rows, response)
    for i, n in enumerate(response_lengths):
        mask[i, :n] = 1
    attention = torch.cat([torch.ones(rows, prompt), mask], dim=1)
    scores = torch.zeros(rows, response)
    return DataProto.from_dict({"response_mask": mask, "attention_mask": attention, "token_level_scores": scores,
                                "token_level_rewards": scores, "advantages": scores, "returns": scores})


def test_response_length_percentiles():
    # 11 rows, lengths 0..8 then 8, 8: p50 is the 6th value (position 5.0), p80 at position 8.0
    lengths = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8]
    out = data_metrics(_batch(lengths), use_critic=False)
    assert out["response_length/p50"] == 5.0
    assert out["response_length/p80"] == 8.0   # position 8.0: the first 8
    assert out["response_length/p95"] == 8.0
    assert out["response_length/max"] == 8.0 and out["response_length/clip_ratio"] == pytest.approx(3 / 11)


def test_long_tail_separates_percentiles_from_the_mean():
    # 18 short answers and 2 long ones: the mean moves, p50 and p80 do not, p95 lands between
    lengths = [2] * 18 + [8, 8]
    out = data_metrics(_batch(lengths), use_critic=False)
    assert out["response_length/p50"] == 2.0 and out["response_length/p80"] == 2.0
    assert out["response_length/p95"] == 8.0   # position 18.05: between 8 and 8
    assert out["response_length/mean"] == pytest.approx(2.6)
    lengths = [2] * 19 + [8]
    p95 = data_metrics(_batch(lengths), use_critic=False)["response_length/p95"]
    assert p95 == pytest.approx(2 + 0.05 * 6, abs=1e-5)  # position 18.05, in float32
