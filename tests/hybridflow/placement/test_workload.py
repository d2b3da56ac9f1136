"""Model shapes: the catalog's parameter counts are the published checkpoints' (the cost model's base)."""
import json

import pytest

from hybridflow.placement.workload import CATALOG, ModelShape, Workload, model_by_name


@pytest.mark.parametrize("name,params", [
    ("llama-2-7b", 6_738_415_616),    # meta-llama/Llama-2-7b-hf safetensors total
    ("llama-2-13b", 13_015_864_320),
    ("codellama-34b", 33_743_970_304),
    ("llama-2-70b", 68_976_648_192),
])
def test_catalog_parameter_counts_match_the_checkpoints(name, params):
    assert CATALOG[name].params == params


def test_from_hf_config_reads_llama_keys_and_defaults_kv_heads():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "tie_word_embeddings": True, "model_type": "llama"}
    shape = ModelShape.from_hf_config(json.loads(json.dumps(cfg)))
    assert shape.kv_heads == 4 and shape.tied
    # per layer: q,o 2*64*64 + k,v 2*64*64 + mlp 3*64*128 + 2 norms; tied embedding 100*64 + final norm
    assert shape.params == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 100 * 64 + 64


def test_aliases_and_unknown_names():
    assert model_by_name("70B") is CATALOG["llama-2-70b"]
    with pytest.raises(KeyError, match="unknown model"):
        model_by_name("71b")


def test_workload_roles_follow_the_models_given():
    s = CATALOG["llama-2-7b"]
    assert Workload(actor=s).roles == ("actor", "ref")
    assert Workload(actor=s, critic=s, reward_model=s).roles == ("actor", "ref", "critic", "reward_model")
    assert Workload(actor=s, reference=False, prompts=8, samples_per_prompt=4).sequences == 32


# Public configs (each checkpoint's config.json, sizes only): Qwen3-0.6B sets head_dim 128 in a
# 1024-wide model of 16 heads, so hidden // heads (64) would halve its Q/O and its KV cache.
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True}
QWEN2_0_5B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
              "tie_word_embeddings": True}
LLAMA_HEAD_DIM = {"model_type": "llama", "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 160, "vocab_size": 200,
                  "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg", [QWEN3_0_6B, QWEN2_0_5B, LLAMA_HEAD_DIM], ids=["qwen3-0.6b", "qwen2-0.5b", "llama"])
def test_parameter_count_equals_the_transformers_model_of_the_config(cfg):
    """The count the planner plans memory with is the one transformers builds (on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    shape = ModelShape.from_hf_config(cfg)
    assert shape.params == built
    assert ModelShape.from_hf_config(config).params == built  # the PretrainedConfig reads the same


def test_head_dim_from_the_config_sizes_the_kv_cache():
    shape = ModelShape.from_hf_config(QWEN3_0_6B)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (128, 2048, 1024)
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2  # 112 KiB a token in bf16
    assert ModelShape.from_hf_config(QWEN2_0_5B).head_dim == 64  # unset: hidden // heads


def test_a_multimodal_config_is_read_from_its_text_part():
    outer = {"model_type": "qwen2_5_vl", "text_config": dict(QWEN2_0_5B, model_type="qwen2_5_vl_text"),
             "vision_config": {"hidden_size": 1280}, "tie_word_embeddings": True}
    shape = ModelShape.from_hf_config(outer, name="vl")
    assert (shape.hidden, shape.layers, shape.kv_heads, shape.vocab, shape.tied) == (896, 24, 2, 151936, True)
