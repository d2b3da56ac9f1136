"""The fused rollout scores chunks as they finish; their merge must be the one call over the batch
(hybridflow/trainer/fused_rollout.py merge_scorings): the same token-level scores, scores, extra
columns, texts and reward metrics, per-source means included."""
import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager import RewardManager
from hybridflow.trainer.fused_rollout import merge_scorings
from hybridflow.trainer.reward_process import score_batch


class Letters:
    """Token id i decodes to a letter: enough of a tokenizer for scoring."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("z"):
        raise ValueError("a reward function that raises on some rows")
    return {"score": len(solution_str) / 10 + (data_source == "b"), "hits": solution_str.count("a")}


def _batch(rows=23, width=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, 26, (rows, width), generator=gen)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    sources = np.array(["a" if i % 3 else "b" for i in range(rows)], dtype=object)
    return DataProto.from_dict({"responses": responses, "response_mask": mask},
                               {"data_source": sources, "ground_truth": np.array([None] * rows, dtype=object)})


@pytest.mark.parametrize("overlong", [None, (3, 1.0)])
def test_chunks_merged_are_the_whole_batch_scored_once(overlong):
    batch = _batch()
    whole = score_batch(Letters, RewardManager(score, overlong_buffer=overlong), batch)
    manager = RewardManager(score, overlong_buffer=overlong)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(1))  # the order rows finish
    scored = [(idx, score_batch(Letters, manager, batch[idx])) for idx in torch.split(perm, [5, 1, 9, 8])]
    merged = merge_scorings(scored, len(batch), manager, batch.non_tensor_batch["data_source"])
    torch.testing.assert_close(merged[0], whole[0])
    assert merged[1] == pytest.approx(whole[1])
    assert merged[3].keys() == whole[3].keys()
    for key in whole[3]:
        assert merged[3][key] == whole[3][key], key
    assert merged[4] == whole[4]
    assert merged[2].keys() == whole[2].keys()
    for key, value in whole[2].items():
        assert merged[2][key] == pytest.approx(value), key
    assert merged[2]["reward/errors"] > 0 and "reward/score/b/mean" in merged[2]


def test_rows_missing_from_the_chunks_are_an_error():
    batch = _batch(rows=6)
    manager = RewardManager(score)
    scored = [(torch.arange(4), score_batch(Letters, manager, batch[:4]))]
    with pytest.raises(RuntimeError, match="4 scored rows for 6 samples"):
        merge_scorings(scored, 6, manager, batch.non_tensor_batch["data_source"])
