"""The rollout pool's read-ahead (hybridflow/trainer/async_rollout.py): which prompts are given to
the rollout with which weights, for each staleness bound, and the loader state a checkpoint keeps.
The worker groups are recorders here; tests/recipes run the real pools."""
import numpy as np
import pytest
import torch

from hybridflow.data.loader import ResumablePromptLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.async_rollout import AheadLoader, staleness_metrics

B = 4  # prompts per batch


class Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class RolloutRecorder:
    """Generates a row per prompt whose 'version' is the weights it holds at the call, in call order."""

    def __init__(self):
        self.version, self.calls = None, []

    def submit(self, method, arg):
        if method == "load_weights":
            self.version = arg.version
            return Done([{"timing_s/weight_sync_load": 0.0}])
        ids = arg.batch["input_ids"][:, 0].tolist()
        self.calls.append((self.version, ids))
        out = DataProto.from_dict({"prompt": torch.tensor(ids),
                                   "rollout_weight_version": torch.full((len(ids),), self.version)})
        return Done(out)


class Staged:
    def __init__(self, version):
        self.version, self.total_bytes = version, 100


class TrainerRecorder:
    def stage_weights(self, version):
        return [Staged(version)]


class Prompts:
    """A data set of 4 * 8 prompts: row i's input_ids start with i."""

    def __len__(self):
        return 8 * B

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i, 0]), "attention_mask": torch.ones(2, dtype=torch.long),
                "position_ids": torch.arange(2)}


def _ahead(staleness, sync_every=1):
    loader = ResumablePromptLoader(Prompts(), B, shuffle=False)
    rollout = RolloutRecorder()
    return AheadLoader(loader, TrainerRecorder(), rollout, batch_size=B, n=1, greedy=False,
                       staleness=staleness, sync_every=sync_every), rollout


def _run(staleness, sync_every=1, steps=5):
    """Each step's (prompts, versions that generated them) and the prompts given before each update."""
    ahead, rollout = _ahead(staleness, sync_every)
    ahead.sync(0, {})
    seen = []
    for step in range(1, steps + 1):
        batch = ahead.next_batch()
        out, _ = ahead.generations({})
        assert out.batch["prompt"].tolist() == batch["input_ids"][:, 0].tolist()  # the batch's own rows
        seen.append(out.batch["rollout_weight_version"].tolist())
        ahead.weights_updated(step, {})
    return seen, rollout.calls


def test_staleness_0_alternates_strictly():
    seen, calls = _run(0.0)
    assert seen == [[k - 1] * B for k in range(1, 6)]  # step k trains on samples of step k-1's weights
    assert [len(ids) for _, ids in calls] == [B] * 5  # one call per batch, none ahead


def test_staleness_1_is_one_step_off():
    seen, calls = _run(1.0)
    assert seen == [[0] * B, [0] * B, [1] * B, [2] * B, [3] * B]
    # batch k+1 was given to the rollout before step k's update: it samples while the trainer trains
    assert [v for v, _ in calls[:3]] == [0, 0, 1]


def test_a_fraction_starts_part_of_the_next_batch_early():
    seen, calls = _run(0.5)
    assert seen[0] == [0] * B
    assert seen[1] == [0, 0, 1, 1]  # half of batch 2 sampled with step 0's weights, the rest with step 1's
    assert [len(ids) for _, ids in calls[:3]] == [B, B // 2, B // 2]


def test_syncs_every_second_step():
    seen, _ = _run(0.0, sync_every=2, steps=4)
    assert seen == [[0] * B, [0] * B, [2] * B, [2] * B]


def test_the_checkpointed_loader_state_generates_the_read_ahead_batch_again():
    ahead, _ = _ahead(1.0)
    ahead.sync(0, {})
    first = ahead.next_batch()
    ahead.generations({})
    state = ahead.state_dict()  # batch 2 was read ahead and given to the rollout: not yet trained on
    resumed, _ = _ahead(1.0)
    resumed.load_state_dict(state)
    resumed.sync(1, {})
    again = resumed.next_batch()
    assert again["input_ids"][:, 0].tolist() == list(range(B, 2 * B)) != first["input_ids"][:, 0].tolist()


def test_next_batch_needs_weights_first():
    ahead, _ = _ahead(0.0)
    with pytest.raises(RuntimeError, match="sync"):
        ahead.next_batch()


def test_staleness_metrics():
    m = staleness_metrics(np.array([2, 2, 1, 1]), step=4)
    assert m == {"async/staleness_mean": 1.5, "async/staleness_max": 2.0, "async/stale_samples_frac": 1.0}


@pytest.mark.parametrize("staleness, calls", [(0.0, 1), (1.0, 2)])
def test_a_resumed_run_reads_ahead_as_far_as_the_uninterrupted_one(staleness, calls):
    """Resumed at step 2 (the loader past its first two batches), step 3 gives the rollout its own
    batch, and the next one only when one step off."""
    ahead, rollout = _ahead(staleness)
    ahead.loader.load_state_dict({**ahead.loader.state_dict(), "batch_in_epoch": 2})
    ahead.sync(2, {})
    batch = ahead.next_batch()
    assert batch["input_ids"][:, 0].tolist() == list(range(2 * B, 3 * B))
    assert len(rollout.calls) == calls and all(v == 2 for v, _ in rollout.calls)


def test_dynamic_sampling_takes_extra_batches_within_a_step():
    """A step that needs a second batch (DAPO) gets it at once, read ahead or generated now, and the
    read-ahead stays one batch beyond the batch last taken."""
    ahead, rollout = _ahead(1.0)
    ahead.sync(0, {})
    versions = []
    for step in (1, 2):
        for _ in range(2):  # two batches a step
            ahead.next_batch()
            versions.append(ahead.generations({})[0].batch["rollout_weight_version"].unique().tolist())
        ahead.weights_updated(step, {})
    assert versions == [[0], [0], [0], [1]]  # step 2's first batch was read ahead during step 1
