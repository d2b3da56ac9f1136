"""The Megatron parameter table of docs/contracts.md, written out independently for these tests.

Production code gets it from ``workers.models.layout.param_specs``; the tests keep their own copy
so that resharding is tested alone, and ``test_plan`` checks both agree once workers/ has it.
Also builds synthetic full HF tensors and the per-rank Megatron shards cut from them.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from resharding.plan import ModelDims, TrainParam


def tiny_dims(heads=4, kv_heads=2, head_dim=2, hidden=8, intermediate=8, vocab=24) -> ModelDims:
    return ModelDims(heads, kv_heads, head_dim, hidden, intermediate, vocab)


def stage_table(dims: ModelDims, layers: int, tp: int, pp: int, pp_rank: int, tied: bool,
                qkv_bias: bool) -> list[TrainParam]:
    h, d, t = dims.hidden, dims.head_dim, tp
    qkv_rows = (dims.num_heads + 2 * dims.num_kv_heads) * d // t
    per = layers // pp
    out = []
    if pp_rank == 0:
        out.append(TrainParam("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0, None,
                              (dims.vocab // t, h)))
    for i in range(per):
        L = pp_rank * per + i
        a, m, pre = f"model.layers.{L}.self_attn.", f"model.layers.{L}.mlp.", f"decoder.layers.{i}."
        out.append(TrainParam(pre + "input_layernorm.weight", (f"model.layers.{L}.input_layernorm.weight",),
                              None, None, (h,)))
        out.append(TrainParam(pre + "self_attention.linear_qkv.weight",
                              (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), 0, "qkv",
                              (qkv_rows, h)))
        if qkv_bias:
            out.append(TrainParam(pre + "self_attention.linear_qkv.bias",
                                  (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), 0, "qkv",
                                  (qkv_rows,)))
        out.append(TrainParam(pre + "self_attention.linear_proj.weight", (a + "o_proj.weight",), 1, None,
                              (h, dims.num_heads * d // t)))
        out.append(TrainParam(pre + "pre_mlp_layernorm.weight",
                              (f"model.layers.{L}.post_attention_layernorm.weight",), None, None, (h,)))
        out.append(TrainParam(pre + "mlp.linear_fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), 0,
                              "gate_up", (2 * dims.intermediate // t, h)))
        out.append(TrainParam(pre + "mlp.linear_fc2.weight", (m + "down_proj.weight",), 1, None,
                              (h, dims.intermediate // t)))
    if pp_rank == pp - 1:
        out.append(TrainParam("decoder.final_layernorm.weight", ("model.norm.weight",), None, None, (h,)))
        if not tied:
            out.append(TrainParam("output_layer.weight", ("lm_head.weight",), 0, None, (dims.vocab // t, h)))
    return out


def full_table(dims, layers, tp, pp, tied=False, qkv_bias=True):
    return [stage_table(dims, layers, tp, pp, s, tied, qkv_bias) for s in range(pp)]


def reference_weights(plan, seed=0) -> dict[str, torch.Tensor]:
    """Distinct values everywhere, so a misplaced element cannot pass unnoticed."""
    g = torch.Generator().manual_seed(seed)
    return {t.hf_name: torch.randn(t.shape, generator=g) for t in plan.tensors}


def megatron_shards(plan, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters, cut and fused from the full HF tensors as the table says."""
    pp_rank, tp_rank, _ = plan.train.coords(rank)
    parts: dict[str, list[torch.Tensor]] = {}
    for t in plan.tensors:
        if t.stage != pp_rank:
            continue
        x = full[t.hf_name]
        if t.split_dim is not None:
            x = x.chunk(plan.train.tp, dim=t.split_dim)[tp_rank]
        parts.setdefault(t.train_name, []).append(x)
    dims = {t.train_name: (t.split_dim or 0) for t in plan.tensors}
    return {n: torch.cat(xs, dim=dims[n]).contiguous() for n, xs in parts.items()}


def hf_config(dims: ModelDims, layers: int):
    return SimpleNamespace(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False,
                           rms_norm_eps=1e-6, num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
                           head_dim=dims.head_dim, hidden_size=dims.hidden,
                           intermediate_size=dims.intermediate, vocab_size=dims.vocab,
                           num_hidden_layers=layers)
