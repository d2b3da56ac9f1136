"""Megatron parameter layout of a Llama-family model (Llama, Qwen2, Qwen3, Mistral): the one
table of names and shards.

docs/contracts.md "Megatron parameter layout" is this file as prose. ``param_specs`` is what
``resharding/`` and the HF <-> Megatron conversion consume; nothing else hard-codes names.
Differences from megatron-core's GPTModel naming: none for the listed tensors. One addition: with
tied embeddings and PP > 1 the last stage holds a copy of the embedding as ``output_layer.weight``
(Megatron does the same); it equals stage 0's ``embedding.word_embeddings.weight`` after every
step, so ``param_specs`` leaves it out (it is not a separate HF tensor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.megatron_models import QK_NORM, QKV_BIAS, architecture, unsupported_reason
from hybridflow.megatron_models import config_value as _get


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Llama/Qwen2/Qwen3/Mistral decoder read from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every query and key head, before RoPE

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelDims":
        reason = unsupported_reason(hf_config)
        if reason:
            raise ValueError(reason)
        arch = architecture(hf_config)
        hidden = int(_get(hf_config, "hidden_size"))
        heads = int(_get(hf_config, "num_attention_heads"))
        return cls(
            architecture=arch,
            vocab_size=int(_get(hf_config, "vocab_size")),
            hidden_size=hidden,
            num_layers=int(_get(hf_config, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(_get(hf_config, "num_key_value_heads") or heads),
            head_dim=int(_get(hf_config, "head_dim") or hidden // heads),
            intermediate_size=int(_get(hf_config, "intermediate_size")),
            rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
            tied_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
            qkv_bias=arch in QKV_BIAS,
            qk_norm=arch in QK_NORM,
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise one clear ValueError per violated divisibility rule (TP splits heads, PP layers)."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp={tp}, pp={pp}: parallel sizes must be >= 1")
        for key, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                           ("vocab_size", self.vocab_size), ("intermediate_size", self.intermediate_size)):
            if value % tp:
                raise ValueError(f"tensor parallel size tp={tp} does not divide the model's {key}={value}: "
                                 f"choose a tp that divides {value}")
        if self.num_layers % pp:
            raise ValueError(f"pipeline parallel size pp={pp} does not divide the model's "
                             f"num_hidden_layers={self.num_layers}: choose a pp that divides {self.num_layers}")

    def stage_layers(self, pp: int, pp_rank: int) -> range:
        """Global indices of the decoder layers on pipeline stage ``pp_rank``."""
        per_stage = self.num_layers // pp
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


@dataclass(frozen=True)
class ParamSpec:
    """One Megatron tensor of a stage and how it maps to HF tensors.

    ``split_dim``: dimension split across TP ranks (None: replicated on every TP rank).
    ``fused``: None, "qkv" (per rank [q_r; k_r; v_r] along dim 0) or "gate_up" ([gate_r; up_r]).
    ``hf_names``: the HF tensors it is made of, in fused order, with global layer indices.
    ``partial_grad``: replicated, but each TP rank applies it to its own heads only (Qwen3's q/k
    norms), so each rank's gradient is a part of the whole and they must be summed over TP.
    """

    name: str
    hf_names: tuple[str, ...]
    split_dim: int | None
    fused: str | None
    shape_per_rank: tuple[int, ...]
    partial_grad: bool = False


def param_specs(hf_config: Any, tp: int, pp: int, pp_rank: int) -> list[ParamSpec]:
    """The Megatron tensors held by every TP rank of pipeline stage ``pp_rank`` (contracts.md)."""
    d = hf_config if isinstance(hf_config, ModelDims) else ModelDims.from_hf(hf_config)
    d.check_parallel(tp, pp)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp - 1}")
    h, hd = d.hidden_size, d.head_dim
    qkv_rows = (d.num_heads + 2 * d.num_kv_heads) // tp * hd
    specs: list[ParamSpec] = []
    if pp_rank == 0:
        specs.append(ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0, None,
                               (d.vocab_size // tp, h)))
    for local_i, layer in enumerate(d.stage_layers(pp, pp_rank)):
        m, hf = f"decoder.layers.{local_i}.", f"model.layers.{layer}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        specs.append(ParamSpec(m + "input_layernorm.weight", (hf + "input_layernorm.weight",), None, None, (h,)))
        specs.append(ParamSpec(m + "self_attention.linear_qkv.weight",
                               tuple(attn + p + "_proj.weight" for p in "qkv"), 0, "qkv", (qkv_rows, h)))
        if d.qkv_bias:
            specs.append(ParamSpec(m + "self_attention.linear_qkv.bias",
                                   tuple(attn + p + "_proj.bias" for p in "qkv"), 0, "qkv", (qkv_rows,)))
        if d.qk_norm:  # megatron-core's names for Qwen3's q_norm/k_norm
            for which in "qk":
                specs.append(ParamSpec(m + f"self_attention.{which}_layernorm.weight",
                                       (attn + f"{which}_norm.weight",), None, None, (hd,), partial_grad=True))
        specs.append(ParamSpec(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), 1, None,
                               (h, d.num_heads * hd // tp)))
        specs.append(ParamSpec(m + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",),
                               None, None, (h,)))
        specs.append(ParamSpec(m + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                               0, "gate_up", (2 * d.intermediate_size // tp, h)))
        specs.append(ParamSpec(m + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), 1, None,
                               (h, d.intermediate_size // tp)))
    if pp_rank == pp - 1:
        specs.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), None, None, (h,)))
        if not d.tied_embeddings:
            specs.append(ParamSpec("output_layer.weight", ("lm_head.weight",), 0, None, (d.vocab_size // tp, h)))
    return specs
