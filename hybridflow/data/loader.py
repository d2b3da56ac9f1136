"""A seeded, resumable prompt loader: the same seed gives the same batches, across restarts.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng((seed, e))``, so
it depends on nothing but (seed, epoch): a run resumed from ``state_dict()`` sees exactly the
batches an uninterrupted run would have seen next. (Keying the generator by the pair rather than
by ``seed + epoch`` keeps seed 0/epoch 1 and seed 1/epoch 0 from sharing an order.)

Unlike ``torch.utils.data.DataLoader`` there are no worker processes: prompts are tokenized when
the data set is built, so a batch is a cheap stack of tensors.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from hybridflow.data.dataset import DataError

TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")


def object_array(values: Sequence) -> np.ndarray:
    """1-D numpy object array; element-wise so equal-length lists do not become a 2-D array."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate_prompts(items: Sequence[dict]) -> dict:
    """Stack dataset items into one batch dict, ready for DataProto.

    Tensors ``input_ids``/``attention_mask``/``position_ids`` are [B, P] int64; every other key
    (``data_source``, ``ground_truth``, ``extra_info``, ``raw_prompt``, ``index``) becomes a numpy
    object array of length B, as the DataProto contract wants for non-tensor data.
    """
    if not items:
        raise ValueError("collate_prompts got an empty batch")
    batch: dict = {k: torch.stack([it[k] for it in items]) for k in TENSOR_KEYS}
    for key in items[0]:
        if key not in TENSOR_KEYS:
            batch[key] = object_array([it[key] for it in items])
    return batch


class ResumablePromptLoader:
    """Batches of ``batch_size`` prompts with an exact, checkpointable position.

    ``for batch in loader`` yields the rest of the current epoch, then moves to the next epoch;
    ``next_batch()`` crosses epoch boundaries by itself. ``len(loader)`` is batches per epoch
    (``N // batch_size`` with ``drop_last``, else ``ceil(N / batch_size)`` with a short last batch).
    ``state_dict()`` records the batches already handed out, so save it after the step that
    consumed the last batch.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, collate_fn=collate_prompts):
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be a positive integer (data.train_batch_size)")
        n = len(dataset)
        if drop_last and n < batch_size:
            raise DataError(f"the data set has {n} prompts (after filtering), fewer than one batch of "
                             f"{batch_size}: lower data.train_batch_size or add data")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, int(seed)
        self.drop_last, self.collate_fn = drop_last, collate_fn
        self.epoch = 0
        self.batch_in_epoch = 0

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Data set indices in the order epoch ``epoch`` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng((self.seed, epoch)).permutation(n)

    def _batch(self, epoch: int, k: int) -> dict:
        order = self.epoch_order(epoch)
        idx = order[k * self.batch_size:(k + 1) * self.batch_size]
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __iter__(self) -> Iterator[dict]:
        while self.batch_in_epoch < len(self):
            batch = self._batch(self.epoch, self.batch_in_epoch)
            self.batch_in_epoch += 1
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0

    def next_batch(self) -> dict:
        """The next batch, starting a new epoch (reshuffled) when the current one is used up."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
        batch = self._batch(self.epoch, self.batch_in_epoch)
        self.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "batch_size": self.batch_size, "dataset_size": len(self.dataset),
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; refuses a state from a loader with a different order."""
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size),
                          ("dataset_size", len(self.dataset)), ("shuffle", self.shuffle),
                          ("drop_last", self.drop_last)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume the data loader: checkpoint has {key}={state[key]!r} but this "
                    f"run has {key}={mine!r}; the data order would differ. Use the same data and "
                    "settings as the checkpointed run")
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
