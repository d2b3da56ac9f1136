import numpy as np
import pytest
import torch

from hybridflow.data.arithmetic import ArithmeticTaskConfig, write_arithmetic_parquet
from hybridflow.data.dataset import RLPromptDataset
from hybridflow.data.loader import ResumablePromptLoader, collate_prompts


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, char_tokenizer):
    out = tmp_path_factory.mktemp("arith")
    train, _ = write_arithmetic_parquet(str(out), ArithmeticTaskConfig(train_size=50, val_size=5, seed=3))
    return RLPromptDataset(train, char_tokenizer, max_prompt_length=8)


def indices(batch):
    return [int(i) for i in batch["index"]]


def test_batch_is_ready_for_dataproto(dataset):
    batch = next(iter(ResumablePromptLoader(dataset, 8, seed=0)))
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (8, 8) and batch[key].dtype == torch.long
    for key in ("data_source", "ground_truth", "extra_info", "raw_prompt", "index"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object
        assert batch[key].shape == (8,)  # equal-length message lists stay one object per row
    assert list(batch["data_source"]) == ["arithmetic"] * 8
    first = dataset[indices(batch)[0]]
    assert torch.equal(batch["input_ids"][0], first["input_ids"])
    assert batch["ground_truth"][0] == first["ground_truth"]


def test_each_epoch_is_a_seeded_permutation_with_drop_last(dataset):
    loader = ResumablePromptLoader(dataset, 8, seed=0)
    assert len(loader) == 6  # 50 // 8
    epoch0 = [i for b in loader for i in indices(b)]
    epoch1 = [i for b in loader for i in indices(b)]
    assert loader.epoch == 2
    assert len(epoch0) == 48 and len(set(epoch0)) == 48
    assert epoch0 != epoch1  # reshuffled every epoch
    again = ResumablePromptLoader(dataset, 8, seed=0)
    assert [i for b in again for i in indices(b)] == epoch0
    other = ResumablePromptLoader(dataset, 8, seed=1)
    assert [i for b in other for i in indices(b)] != epoch0


def test_without_drop_last_the_last_batch_is_short_and_all_rows_are_seen(dataset):
    loader = ResumablePromptLoader(dataset, 8, seed=0, drop_last=False)
    sizes = [len(b["index"]) for b in loader]
    assert len(loader) == 7 and sizes == [8] * 6 + [2]
    plain = ResumablePromptLoader(dataset, 8, shuffle=False, drop_last=False)
    assert [i for b in plain for i in indices(b)] == list(range(50))


def run_steps(loader, steps):
    return [indices(loader.next_batch()) for _ in range(steps)]


@pytest.mark.parametrize("stop_after", [3, 6, 8])  # mid-epoch, exactly at the boundary, in epoch 1
def test_resume_sees_exactly_the_uninterrupted_order(dataset, stop_after):
    reference = run_steps(ResumablePromptLoader(dataset, 8, seed=5), 15)
    first = ResumablePromptLoader(dataset, 8, seed=5)
    seen = run_steps(first, stop_after)
    state = first.state_dict()
    resumed = ResumablePromptLoader(dataset, 8, seed=5)
    resumed.load_state_dict(state)
    assert seen + run_steps(resumed, 15 - stop_after) == reference


def test_resume_with_epoch_loops(dataset):
    """A trainer that loops `for epoch ...: for batch in loader` resumes at the same batch."""
    def train(loader, total_epochs, stop_at=None):
        seen = []
        for _ in range(loader.epoch, total_epochs):
            for batch in loader:
                seen.append(indices(batch))
                if len(seen) == stop_at:
                    return seen, loader.state_dict()
        return seen, None

    reference, _ = train(ResumablePromptLoader(dataset, 8, seed=2), 3)
    for stop in (4, 6):  # 6 = the last batch of epoch 0 (state saved before the epoch rolls over)
        head, state = train(ResumablePromptLoader(dataset, 8, seed=2), 3, stop_at=stop)
        resumed = ResumablePromptLoader(dataset, 8, seed=2)
        resumed.load_state_dict(state)
        tail, _ = train(resumed, 3)
        assert head + tail == reference


def test_load_state_from_a_different_order_is_refused(dataset):
    state = ResumablePromptLoader(dataset, 8, seed=0).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=0 but this run has seed=1"):
        ResumablePromptLoader(dataset, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        ResumablePromptLoader(dataset, 10, seed=0).load_state_dict(state)


def test_too_small_data_set_and_bad_batch_size_fail_clearly(dataset):
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        ResumablePromptLoader(dataset, 64)
    with pytest.raises(ValueError, match="positive integer"):
        ResumablePromptLoader(dataset, 0)
    with pytest.raises(ValueError, match="empty batch"):
        collate_prompts([])
