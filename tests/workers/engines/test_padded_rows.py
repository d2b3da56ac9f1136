"""A training step refuses a batch part the controller padded (its copied rows would train twice)."""
import pytest
import torch

from hybridflow.protocol import DataProto
from workers.engines.base import refuse_padded_rows


def make(n):
    return DataProto.from_dict({"ids": torch.arange(n)})


def test_a_training_step_refuses_a_padded_part():
    parts, _ = make(7).dp_chunks(2)
    with pytest.raises(ValueError, match="padded this batch with 1 copied rows to split it over 2 data-parallel "
                                         "ranks, so those rows would train twice; send a multiple of 2 rows"):
        refuse_padded_rows(parts[0], 2)
    refuse_padded_rows(make(8).dp_chunks(2)[0][0], 2)
