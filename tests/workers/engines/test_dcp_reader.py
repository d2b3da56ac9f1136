"""The engines' checkpoint files are read as data only: DCP's pickled ``.metadata`` and byte
entries, FSDP's ``extra_rank{r}.pt``, the Megatron per-rank files and the workers' RNG files. A
crafted file is a CheckpointError naming it, and runs nothing; real files still round-trip."""
from __future__ import annotations

import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch

from hybridflow.checkpoint_files import CheckpointError, load_tensors


class RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model_and_adamw(lr):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _dcp_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def test_dcp_folder_round_trips_and_a_crafted_metadata_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    from workers.engines.dcp_reader import SafeLoadPlanner, safe_reader

    saved = _dcp_state(*_model_and_adamw(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        state = _dcp_state(*_model_and_adamw(5e-3))
        dcp.load(state, storage_reader=safe_reader(str(tmp_path / "dcp")), planner=SafeLoadPlanner(), no_dist=True)
    assert state["optim"]["param_groups"][0]["lr"] == 1e-3  # a byte entry, read with weights_only=True
    assert all(torch.equal(state["model"][k], saved["model"][k]) for k in saved["model"])

    marker = tmp_path / "pwned"
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    with pytest.raises(CheckpointError, match=r"dcp/.metadata is not a DCP metadata file.*open is not part of"):
        safe_reader(str(tmp_path / "dcp")).read_metadata()
    assert not marker.exists()


def test_state_files_load_as_data_and_crafted_ones_are_refused(tmp_path):
    """What extra_rank{r}.pt and megatron/tp{t}_pp{p}.pt hold (optimizer and LambdaLR scheduler
    state, RNG, tensors) loads with weights_only=True; a pickle naming a function does not."""
    model, optimizer = _model_and_adamw(1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": {"cpu": torch.get_rng_state()}, "world_size": 2}
    torch.save(state, tmp_path / "extra_rank0.pt")
    loaded = load_tensors(str(tmp_path / "extra_rank0.pt"))
    assert loaded["scheduler"] == scheduler.state_dict() and torch.equal(loaded["rng"]["cpu"], state["rng"]["cpu"])

    marker = tmp_path / "pwned"
    torch.save({"rng": RunsCode(marker)}, tmp_path / "extra_rank1.pt")
    with pytest.raises(CheckpointError, match=r"extra_rank1.pt is not a checkpoint file this version can read"):
        load_tensors(str(tmp_path / "extra_rank1.pt"))
    (tmp_path / "garbage.pt").write_bytes(b"\x00garbage" * 20)
    with pytest.raises(CheckpointError, match=r"garbage.pt is not a checkpoint file.*resume_mode"):
        load_tensors(str(tmp_path / "garbage.pt"))
    assert not marker.exists()


def test_worker_rng_round_trips_without_pickled_numpy_state(tmp_path):
    from workers.checkpoint import load_worker_rng, save_worker_rng

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()
    save_worker_rng(str(tmp_path), 0)
    expected = (random.random(), np.random.randn(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_worker_rng(str(tmp_path), 0)
    got = (random.random(), np.random.randn(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])

    torch.save({"python": RunsCode(tmp_path / "pwned")}, os.path.join(tmp_path, "worker_rng_rank1.pt"))
    with pytest.raises(CheckpointError, match="worker_rng_rank1.pt is not a checkpoint file"):
        load_worker_rng(str(tmp_path), 1)
    assert not (tmp_path / "pwned").exists()
