"""fsdp_size -> parameter layout rules (the multi-rank behaviour is in test_fsdp_engine.py)."""
import pytest

from workers.engines.fsdp_layout import resolve_shard_size


@pytest.mark.parametrize("fsdp_size,dp,expected", [(-1, 4, 4), (4, 4, 4), (2, 4, 2), (1, 4, 1), (-1, 1, 1)])
def test_shard_size_resolves(fsdp_size, dp, expected):
    assert resolve_shard_size(fsdp_size, dp) == expected


@pytest.mark.parametrize("fsdp_size,dp", [(3, 4), (8, 4), (0, 2)])
def test_shard_size_that_does_not_divide_names_the_choices(fsdp_size, dp):
    with pytest.raises(ValueError, match=rf"fsdp_size={fsdp_size} must divide the {dp} data-parallel ranks: .*one of"):
        resolve_shard_size(fsdp_size, dp)
