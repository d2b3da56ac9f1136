"""Shared rollout post-processing and settings: exact tensors for hand-made generations."""
import pytest
import torch

from hybridflow.protocol import DataProto
from workers.rollout.base import (RolloutConfig, build_rollout_batch, generation_layout,
                                  prompt_token_lists, resolve_sampling, special_token_ids,
                                  truncate_at_stop)
from workers.rollout.vllm_rollout import check_generation_tp

PAD, EOS = 0, 2


def _prompts():
    # two prompts left-padded to P=4: [7, 8] and [5, 6, 9]
    ids = torch.tensor([[PAD, PAD, 7, 8], [PAD, 5, 6, 9]])
    mask = (ids != PAD).long()
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": torch.clamp(mask.cumsum(1) - 1, min=0)},
                               {"uid": ["a", "b"]}, {"temperature": 1.0})


def test_build_rollout_batch_exact_layout():
    # prompt a: EOS at the first token, and a response cut at R=3; prompt b: 2 tokens ending at EOS
    samples = [[([EOS], [-0.5]), ([11, 12, 13], [-1.0, -2.0, -3.0])],
               [([14, EOS], [-0.25, -0.75]), ([15, 16, EOS], [-1.5, -0.125, -0.375])]]
    out = build_rollout_batch(_prompts(), samples, response_length=3, pad_token_id=PAD)
    b = out.batch
    assert b["responses"].tolist() == [[EOS, PAD, PAD], [11, 12, 13], [14, EOS, PAD], [15, 16, EOS]]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert b["prompts"].tolist() == [[PAD, PAD, 7, 8]] * 2 + [[PAD, 5, 6, 9]] * 2
    assert b["input_ids"][0].tolist() == [PAD, PAD, 7, 8, EOS, PAD, PAD]
    assert b["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1],
                                            [0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2], [0, 0, 0, 1, 2, 3, 4],
                                          [0, 0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 3, 4, 5]]
    assert b["rollout_log_probs"].tolist() == [[-0.5, 0, 0], [-1.0, -2.0, -3.0],
                                               [-0.25, -0.75, 0], [-1.5, -0.125, -0.375]]
    assert b["rollout_log_probs"].dtype == torch.float32
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert out.meta_info == {"temperature": 1.0}


def test_build_rollout_batch_rejects_ragged_samples():
    with pytest.raises(ValueError, match="same number of samples"):
        build_rollout_batch(_prompts(), [[([1], [0.0])], []], 3, PAD)


def test_truncate_at_stop_keeps_the_stop_token_and_respects_max_tokens():
    assert truncate_at_stop([5, 2, 7], [-1, -2, -3], [2], 10) == ([5, 2], [-1, -2])
    assert truncate_at_stop([5, 6, 7], [-1, -2, -3], [2], 2) == ([5, 6], [-1, -2])


def test_resolve_sampling_overrides_and_greedy():
    cfg = RolloutConfig(n=4, temperature=0.9, top_p=0.8, top_k=20, response_length=16,
                        stop_token_ids=[9])
    s = resolve_sampling(cfg, {}, [EOS])
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_tokens) == (4, 0.9, 0.8, 20, 16)
    assert s.stop_token_ids == (EOS, 9)
    s = resolve_sampling(cfg, {"n": 2, "temperature": 1.0, "max_tokens": 5, "stop_token_ids": [7]}, [EOS])
    assert (s.n, s.temperature, s.max_tokens, s.stop_token_ids) == (2, 1.0, 5, (EOS, 7))
    s = resolve_sampling(cfg, {"do_sample": False}, [EOS])
    assert s.greedy and (s.n, s.top_p, s.top_k) == (1, 1.0, -1)
    with pytest.raises(ValueError, match="response_length=16"):
        resolve_sampling(cfg, {"max_tokens": 17}, [EOS])


def test_prompt_longer_than_prompt_length_is_a_clear_error():
    assert prompt_token_lists(_prompts(), 3) == [[7, 8], [5, 6, 9]]
    with pytest.raises(ValueError, match=r"prompt 1 has 3 tokens > rollout.prompt_length=2"):
        prompt_token_lists(_prompts(), 2)


def test_generation_layout_and_tp_checks():
    assert [generation_layout(r, 4, 2) for r in range(4)] == [
        (0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 must divide the worker group's world size 4"):
        check_generation_tp(3, 4, 12)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads=4"):
        check_generation_tp(8, 8, 4)


def test_config_validation():
    with pytest.raises(ValueError, match="rollout.name='sglang'"):
        RolloutConfig(name="sglang")
    with pytest.raises(ValueError, match="unknown settings"):
        RolloutConfig.from_dict({"temprature": 1.0})
    assert RolloutConfig.from_dict({"max_tokens": 64}).response_length == 64
    with pytest.raises(ValueError, match="rollout.top_k=0"):
        RolloutConfig(top_k=0)


def test_special_token_ids_prefers_generation_config():
    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)
    assert special_token_ids(Cfg(eos_token_id=2, pad_token_id=None)) == (2, [2])
    assert special_token_ids(Cfg(eos_token_id=2, pad_token_id=0), Cfg(eos_token_id=[2, 5])) == (0, [2, 5])
