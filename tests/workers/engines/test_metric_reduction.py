"""How an engine's per-micro-batch loss metrics become one number: row-weighted means, except
``*_max`` metrics, which are the maximum (a mean of per-micro-batch maxima hid the worst token)."""
import pytest
import torch

from hybridflow.protocol import DataProto
from workers.engines.base import local_metric_means


def _micro(rows_with_tokens: int, padding_rows: int = 0) -> DataProto:
    mask = torch.cat([torch.ones(rows_with_tokens, 3), torch.zeros(padding_rows, 3)])
    return DataProto.from_single_dict({"response_mask": mask})


def test_means_are_row_weighted_and_maxima_are_maxima():
    micros = [_micro(3), _micro(1, padding_rows=2)]  # padding rows carry no weight
    results = [{"actor/pg_loss": 1.0, "training/rollout_probs_diff_max": 0.5},
               {"actor/pg_loss": 5.0, "training/rollout_probs_diff_max": 0.1}]
    metrics, rows = local_metric_means(micros, results)
    assert rows == 4
    assert metrics["actor/pg_loss"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)
    assert metrics["training/rollout_probs_diff_max"] == 0.5


def test_a_stage_without_results_reports_rows_only():
    metrics, rows = local_metric_means([_micro(2), _micro(2)], [])  # a pipeline's earlier stage
    assert metrics == {} and rows == 4


def test_a_micro_batch_without_a_metric_counts_as_zero_in_its_mean():
    metrics, _ = local_metric_means([_micro(1), _micro(3)], [{"actor/kl_loss": 2.0}, {}])
    assert metrics["actor/kl_loss"] == pytest.approx(2.0 / 4)
