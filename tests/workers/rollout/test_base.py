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


def test_config_greedy_and_ignore_eos_apply_unless_a_call_overrides_them():
    greedy = RolloutConfig(temperature=0.9, top_k=20, do_sample=False, response_length=16)
    s = resolve_sampling(greedy, {"n": 1}, [EOS])  # what the trainer's training rollout passes
    assert s.greedy and (s.n, s.top_k, s.stop_token_ids, s.ignore_eos) == (1, -1, (EOS,), False)
    assert not resolve_sampling(greedy, {"do_sample": True}, [EOS]).greedy
    ignore = RolloutConfig(ignore_eos=True, stop_token_ids=[9])
    s = resolve_sampling(ignore, {}, [EOS])
    assert s.ignore_eos and s.stop_token_ids == (9,)  # EOS is no stop token; extra stop ids still are
    assert resolve_sampling(ignore, {"ignore_eos": False}, [EOS]).stop_token_ids == (EOS, 9)


def test_ignore_eos_responses_keep_their_eos_and_cover_the_whole_length():
    s = resolve_sampling(RolloutConfig(ignore_eos=True, response_length=3), {}, [EOS])
    samples = [[truncate_at_stop([EOS, 11, EOS], [-1.0, -2.0, -3.0], s.stop_token_ids, s.max_tokens)],
               [truncate_at_stop([12, 13, 14], [-1.0, -1.0, -1.0], s.stop_token_ids, s.max_tokens)]]
    b = build_rollout_batch(_prompts(), samples, response_length=3, pad_token_id=PAD).batch
    assert b["responses"].tolist() == [[EOS, 11, EOS], [12, 13, 14]]
    assert b["response_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_max_model_len_is_the_engine_context():
    assert RolloutConfig(prompt_length=8, response_length=4).context_length == 12
    assert RolloutConfig(prompt_length=8, response_length=4, max_model_len=20).context_length == 20
    with pytest.raises(ValueError, match=r"rollout.max_model_len=11 must be >= prompt_length \+ response_length = 12"):
        RolloutConfig(prompt_length=8, response_length=4, max_model_len=11)


def test_vllm_arguments_hybridflow_sets_are_the_ones_the_config_check_reserves():
    """engine_kwargs.vllm may not override an argument of llm_kwargs: the config check before any
    worker starts must know every one of them (GPU and CPU)."""
    from hybridflow.config.rules import VLLM_KWARGS_FIXED, VLLM_KWARGS_FROM_KEYS
    from workers.rollout.vllm_rollout import llm_kwargs

    config = RolloutConfig(prompt_length=8, response_length=4, max_model_len=20, load_format="dummy",
                           enable_prefix_caching=False, disable_log_stats=False, vllm_engine_kwargs={"x": 1})
    hf_config = type("HFConfig", (), {"dtype": "float32"})()
    cpu, gpu = (llm_kwargs(config, "/m", hf_config, dp_rank=1, on_gpu=on_gpu) for on_gpu in (False, True))
    assert set(cpu) | set(gpu) <= set(VLLM_KWARGS_FROM_KEYS) | set(VLLM_KWARGS_FIXED)
    assert (cpu["max_model_len"], cpu["load_format"], cpu["enable_prefix_caching"], cpu["disable_log_stats"],
            cpu["seed"]) == (20, "dummy", False, False, 1)
    assert "x" not in cpu  # passed through by the engine's constructor call, beside these


def test_load_formats_the_config_accepts_are_vllms():
    from typing import get_args

    from vllm.model_executor.model_loader import LoadFormats

    from hybridflow.config.rules import ROLLOUT_LOAD_FORMATS

    vllm_names = {"dummy" if name.startswith("dummy") else name for name in ROLLOUT_LOAD_FORMATS}
    assert vllm_names <= set(get_args(LoadFormats))


def test_vllm_builds_its_model_with_the_actors_override_config():
    """vLLM gets the training engines' own function as hf_overrides (a callable), only when the
    run overrides something: its dict form would keep the checkpoint's rope_theta."""
    from transformers import Qwen2Config

    from workers.rollout.vllm_rollout import llm_kwargs

    hf_config = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2)
    plain = RolloutConfig(prompt_length=8, response_length=4)
    assert "hf_overrides" not in llm_kwargs(plain, "/m", hf_config, dp_rank=0, on_gpu=False)
    overridden = RolloutConfig(prompt_length=8, response_length=4,
                               hf_overrides={"rope_theta": 50.0, "rms_norm_eps": 0.3})
    engine_config = llm_kwargs(overridden, "/m", hf_config, dp_rank=0, on_gpu=False)["hf_overrides"](hf_config)
    assert (engine_config.rope_parameters["rope_theta"], engine_config.rms_norm_eps) == (50.0, 0.3)
