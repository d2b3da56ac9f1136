"""Read a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP pickles two things: the folder's ``.metadata`` (which tensor lives where) and the non-tensor
entries of a state dict (the optimizer's param_groups: lr, betas, ...), and reads them back with a
plain ``pickle.load`` / ``torch.load(weights_only=False)``: a crafted file could name any function
to call. Both readers here refuse that:

- ``SafeFileSystemReader.read_metadata`` unpickles ``.metadata`` allowing only DCP's own metadata
  classes, ``torch.Size``, torch dtypes and layouts and a path (what ``dcp.save`` writes: the full
  list was read off a saved checkpoint of model + AdamW state);
- ``SafeLoadPlanner.load_bytes`` reads the byte entries with ``weights_only=True``.

The FSDP engine's resume and the HF export both read DCP folders through them. A file that
names anything else is a ``CheckpointError`` naming it.
"""
from __future__ import annotations

import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo

from hybridflow.checkpoint_files import UNREADABLE, WAY_OUT, CheckpointError

_ALLOWED = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        # FileSystemReader.read_metadata of torch 2.13, with the restricted unpickler
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except UNREADABLE as err:
            raise CheckpointError(f"{path} is not a DCP metadata file this version can read ({type(err).__name__}: "
                                  f"{err}): {WAY_OUT}") from err
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(path: str) -> SafeFileSystemReader:
    return SafeFileSystemReader(path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except UNREADABLE as err:
            raise CheckpointError(f"DCP entry {read_item.dest_index.fqn} is not plain data ({type(err).__name__}): "
                                  f"{WAY_OUT}") from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
