"""The Megatron parameter table (docs/contracts.md), HF <-> shard conversion and layout errors."""
from __future__ import annotations

import re

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint, tiny_config
from workers.models.convert import HFCheckpointReader, hf_shapes, hf_to_shard, shards_to_hf
from workers.models.layout import ModelDims, param_specs


def test_table_for_tied_qwen2_tp2_pp2():
    cfg = tiny_config("qwen2", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, tied=True)
    first = {s.name: s for s in param_specs(cfg, tp=2, pp=2, pp_rank=0)}
    last = {s.name: s for s in param_specs(cfg, tp=2, pp=2, pp_rank=1)}
    d = 32  # head_dim = 128 / 4
    assert first["embedding.word_embeddings.weight"].shape_per_rank == (64, 128)
    qkv = first["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape_per_rank == ((4 + 2 * 2) // 2 * d, 128) and qkv.fused == "qkv" and qkv.split_dim == 0
    assert qkv.hf_names == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert first["decoder.layers.0.self_attention.linear_qkv.bias"].shape_per_rank == (4 * d,)
    assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape_per_rank == (128, 2 * d)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape_per_rank == (256, 128)
    assert first["decoder.layers.0.mlp.linear_fc2.weight"].split_dim == 1
    assert first["decoder.layers.0.input_layernorm.weight"].split_dim is None
    # stage 1 numbers its layers locally from 0 but maps them to global layer 1
    assert last["decoder.layers.0.pre_mlp_layernorm.weight"].hf_names == (
        "model.layers.1.post_attention_layernorm.weight",)
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in first
    assert "output_layer.weight" not in last  # tied: the HF checkpoint has no lm_head
    assert not any(n.startswith("embedding") for n in last)


def test_table_for_untied_llama_has_lm_head_and_no_qkv_bias():
    cfg = tiny_config("llama", tied=False)
    specs = {s.name: s for s in param_specs(cfg, tp=1, pp=1, pp_rank=0)}
    assert specs["output_layer.weight"].hf_names == ("lm_head.weight",)
    assert specs["output_layer.weight"].shape_per_rank == (128, 128)
    assert not any(n.endswith("linear_qkv.bias") for n in specs)
    assert len([n for n in specs if ".layers." in n]) == 2 * 6


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False), ("qwen3", True), ("mistral", False)])
def test_shard_and_merge_round_trip(tmp_path, arch, tied):
    path = make_tiny_checkpoint(str(tmp_path / arch), arch=arch, tied=tied, layers=2)
    reader = HFCheckpointReader(path)
    dims = ModelDims.from_hf(tiny_config(arch, tied=tied))
    tp = 2
    for pp_rank in range(2):
        for spec in param_specs(dims, tp, 2, pp_rank):
            shards = [hf_to_shard(spec, reader.get, tp, r) for r in range(tp)]
            assert all(tuple(s.shape) == spec.shape_per_rank for s in shards), spec.name
            merged = shards_to_hf(spec, shards, dims)
            assert [n for n, _ in merged] == list(spec.hf_names)
            for (name, tensor), shape in zip(merged, hf_shapes(spec, dims, tp)):
                assert tuple(tensor.shape) == shape
                assert torch.equal(tensor, reader.get(name)), name
    # rank 1 of the fused qkv starts with the query rows of heads 2..3 (its own heads), then k, v
    spec = next(s for s in param_specs(dims, tp, 2, 0) if s.fused == "qkv")
    q = reader.get("model.layers.0.self_attn.q_proj.weight")
    k = reader.get("model.layers.0.self_attn.k_proj.weight")
    shard = hf_to_shard(spec, reader.get, tp, 1)
    q_rows, kv_rows = dims.num_heads // tp * dims.head_dim, dims.num_kv_heads // tp * dims.head_dim
    assert torch.equal(shard[:q_rows], q[q_rows:]) and torch.equal(shard[q_rows:q_rows + kv_rows], k[kv_rows:])


def test_table_for_qwen3_has_replicated_head_norms_and_its_own_head_dim():
    cfg = tiny_config("qwen3", hidden=128, heads=4, kv_heads=2, head_dim=48)  # q_proj: 192 rows, not 128
    specs = {s.name: s for s in param_specs(cfg, tp=2, pp=1, pp_rank=0)}
    layer = "decoder.layers.1.self_attention."
    assert specs[layer + "linear_qkv.weight"].shape_per_rank == ((4 + 2 * 2) // 2 * 48, 128)
    assert specs[layer + "linear_proj.weight"].shape_per_rank == (128, 2 * 48)
    for which in "qk":
        norm = specs[f"{layer}{which}_layernorm.weight"]
        assert norm.hf_names == (f"model.layers.1.self_attn.{which}_norm.weight",)
        # replicated, yet each TP rank normalises only its own heads: the gradients are partial
        assert (norm.split_dim, norm.shape_per_rank, norm.partial_grad) == (None, (48,), True)
    assert not any(n.endswith("linear_qkv.bias") for n in specs)
    assert not any(s.partial_grad for s in param_specs(tiny_config("qwen2"), tp=2, pp=1, pp_rank=0))


def test_mistral_is_the_llama_table_while_its_window_covers_every_position():
    llama, mistral = tiny_config("llama", tied=False), tiny_config("mistral", tied=False)
    strip = [(s.name, s.hf_names, s.shape_per_rank) for s in param_specs(llama, tp=2, pp=2, pp_rank=1)]
    assert [(s.name, s.hf_names, s.shape_per_rank) for s in param_specs(mistral, tp=2, pp=2, pp_rank=1)] == strip
    mistral.sliding_window = 128
    with pytest.raises(ValueError, match=re.escape("sliding_window=128 (below max_position_embeddings=512)")):
        ModelDims.from_hf(mistral)


@pytest.mark.parametrize("overrides,tp,pp,needle", [
    (dict(heads=4, kv_heads=2), 3, 1, "tp=3 does not divide the model's num_attention_heads=4"),
    (dict(heads=4, kv_heads=2), 4, 1, "tp=4 does not divide the model's num_key_value_heads=2"),
    (dict(heads=4, kv_heads=4, vocab_size=130), 4, 1, "tp=4 does not divide the model's vocab_size=130"),
    (dict(heads=4, kv_heads=4, intermediate=250), 4, 1, "does not divide the model's intermediate_size=250"),
    (dict(layers=3), 1, 2, "pp=2 does not divide the model's num_hidden_layers=3"),
])
def test_parallel_size_errors_name_the_key(overrides, tp, pp, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        param_specs(tiny_config("qwen2", **overrides), tp=tp, pp=pp, pp_rank=0)


def test_unsupported_architecture_names_the_supported_ones():
    cfg = tiny_config("llama")
    cfg.architectures = ["Gemma2ForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM"):
        ModelDims.from_hf(cfg)
    # a critic saved as *ForTokenClassification has the same backbone and is accepted
    cfg.architectures = ["Qwen2ForTokenClassification"]
    assert ModelDims.from_hf(cfg).architecture == "Qwen2ForCausalLM"
