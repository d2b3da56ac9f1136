"""The CPU engine's default KV cache (workers/rollout/kv_cache_size.py): what the engine can use at
once, at most the former fixed 1 GiB. (That vLLM builds a working engine on it, and holds every
sequence of a full batch at once, is checked in test_vllm_rollout.py.)"""
from types import SimpleNamespace

from transformers import Qwen2Config

from hybridflow.tiny import tiny_config
from workers.rollout.base import RolloutConfig
from workers.rollout.kv_cache_size import GiB, auto_kv_cache_bytes, kv_bytes_per_token
from workers.rollout.vllm_rollout import llm_kwargs


def test_the_demo_model_gets_what_its_full_batch_needs_not_a_gib():
    config = tiny_config("qwen2")  # 2 layers, 2 KV heads of 32
    assert kv_bytes_per_token(config, 4) == 2 * 2 * 2 * 32 * 4
    # 256 sequences of a 40-token context, each rounded up to a 256-token share
    assert auto_kv_cache_bytes(config, "float32", 256, 40) == 256 * 256 * 1024 == 64 * 2**20
    assert auto_kv_cache_bytes(config, "bfloat16", 256, 40) == 32 * 2**20
    assert auto_kv_cache_bytes(config, "auto", 256, 40) == 64 * 2**20  # unknown width: counted as fp32


def test_look_ahead_and_a_draft_model_are_counted():
    config = tiny_config("qwen2")
    # 254 + 4 draft tokens cross into a second 256-token share
    assert auto_kv_cache_bytes(config, "float32", 8, 254, lookahead=4) == 8 * 512 * 1024
    draft = SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, hidden_size=64)  # head_dim 16, MHA
    per_token = 1024 + 2 * 1 * 4 * 16 * 4
    assert auto_kv_cache_bytes(config, "float32", 8, 40, draft_hf_config=draft) == 8 * 256 * per_token


def test_a_big_workload_keeps_the_former_gib_and_an_unreadable_config_gets_it():
    big = Qwen2Config(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    assert auto_kv_cache_bytes(big, "bfloat16", 256, 4096) == GiB
    assert auto_kv_cache_bytes(SimpleNamespace(), "float32", 4, 40) == GiB


def test_the_engine_is_given_the_auto_size_unless_the_user_sets_one():
    hf = tiny_config("qwen2")
    auto = RolloutConfig(prompt_length=16, response_length=24, max_num_seqs=64)
    assert llm_kwargs(auto, "m", hf, 0, on_gpu=False)["kv_cache_memory_bytes"] == 64 * 256 * 1024
    fixed = RolloutConfig(prompt_length=16, response_length=24, kv_cache_gib=0.5)
    assert llm_kwargs(fixed, "m", hf, 0, on_gpu=False)["kv_cache_memory_bytes"] == GiB // 2
    assert "kv_cache_memory_bytes" not in llm_kwargs(auto, "m", hf, 0, on_gpu=True)
