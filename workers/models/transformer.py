"""One pipeline stage of a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) built from
megatron-core TP layers.

Why not megatron-core's GPTModel: it calls ``torch.cuda`` in rotary embeddings and attention
(docs/environment.md), so it cannot run on CPU. This module uses only ``megatron.core.tensor_parallel``
layers (which run on gloo) and torch SDPA, and reproduces HF's numerics: RMSNorm in fp32, RoPE
with the ``rotate_half`` convention and HF's inv_freq (including scaled rope types via HF's own
init functions), grouped-query attention, Qwen3's per-head q/k RMSNorm. Module names are the table of ``layout.py``.

Differences from the textbook decoder: activations stay ``[batch, seq, hidden]`` (no sequence
parallelism); TP ranks hold ``nq/tp`` query heads and ``nkv/tp`` key/value heads each, so GQA
groups never cross ranks; a stage returns final-normed hidden states and the heads (``logits``,
``values``) are applied by the caller on just the positions it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from torch import Tensor, nn

from workers.models.layout import ModelDims

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SharedPrompts:
    """Rows of a micro-batch that repeat a prompt (GRPO's n samples), for a forward that runs each
    distinct prompt once: ``first_rows`` ``[U]`` one row per distinct prompt, ``inverse`` ``[m]``
    each row's prompt number, ``prompt_cols`` the prompt's leading columns of the input.
    (``workers/engines/prefix_sharing.distinct_prompts`` finds them.)"""

    first_rows: Tensor
    inverse: Tensor
    prompt_cols: int


@dataclass(frozen=True)
class _FlatBatch:
    """How a flat token sequence ``[1, U*P + m*R, h]`` splits into prompts ``[U, P]`` and
    responses ``[m, R]``, with their rotary tables and attention masks."""

    u: int
    p: int
    m: int
    r: int
    cos_p: Tensor
    sin_p: Tensor
    cos_r: Tensor
    sin_r: Tensor
    mask_p: Tensor  # [U, 1, P, P]
    mask_r: Tensor  # [m, 1, R, P + R]: a row's own prompt keys, then its response keys
    inverse: Tensor


def _skip_init(weight: Tensor) -> None:
    """Weights are loaded from a checkpoint right after construction; initialising them is waste."""


def parallel_config(tp: int, pp: int, params_dtype: torch.dtype) -> ModelParallelConfig:
    """The ModelParallelConfig that works on CPU/gloo as well as GPU/NCCL.

    use_cpu_initialization allocates parameters on the host (no torch.cuda call); the caller moves
    the stage to its device. gradient_accumulation_fusion needs an APEX CUDA kernel: off.
    """
    return ModelParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=params_dtype,
        pipeline_dtype=params_dtype, use_cpu_initialization=True, perform_initialization=False,
        gradient_accumulation_fusion=False, sequence_parallel=False,
        bf16=params_dtype == torch.bfloat16)


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in fp32, cast back, then scale (the order matters in bf16)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit ``position_ids`` (left padding shifts positions per row)."""

    def __init__(self, hf_config: Any, head_dim: int):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:  # llama3 / yarn / linear ...: HF's own init so the frequencies match exactly
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_type={rope_type!r} is not supported: use one of "
                                 f"default, {', '.join(ROPE_INIT_FUNCTIONS)}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``[b, heads, s, hd]``; ``cos``/``sin`` ``[b, s, hd]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    """GQA attention; ``linear_qkv`` rows per rank are ``[q_r; k_r; v_r]`` (layout.py)."""

    def __init__(self, dims: ModelDims, cfg: ModelParallelConfig):
        super().__init__()
        tp = cfg.tensor_model_parallel_size
        self.nq, self.nkv, self.hd = dims.num_heads // tp, dims.num_kv_heads // tp, dims.head_dim
        self.linear_qkv = ColumnParallelLinear(
            dims.hidden_size, (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim, config=cfg,
            init_method=_skip_init, bias=dims.qkv_bias, gather_output=False)
        self.linear_proj = RowParallelLinear(
            dims.num_heads * dims.head_dim, dims.hidden_size, config=cfg, init_method=_skip_init,
            bias=False, input_is_parallel=True, skip_bias_add=False)
        if dims.qk_norm:  # replicated over TP; GradientSync sums their per-rank (per-head-slice) gradients
            self.q_layernorm = RMSNorm(dims.head_dim, dims.rms_norm_eps, cfg.params_dtype)
            self.k_layernorm = RMSNorm(dims.head_dim, dims.rms_norm_eps, cfg.params_dtype)

    def _heads(self, qkv: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k = q.reshape(rows, cols, self.nq, self.hd), k.reshape(rows, cols, self.nkv, self.hd)
        if hasattr(self, "q_layernorm"):  # Qwen3 normalises each head before RoPE
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.reshape(rows, cols, self.nkv, self.hd).transpose(1, 2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """SDPA with HF's repeat_kv (query head j uses kv head j // group); ``[b, s, nq*hd]``."""
        group = self.nq // self.nkv
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # mask None: no padding key anywhere, so the causal kernel (flash on GPU) does the masking
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], self.nq * self.hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv, _ = self.linear_qkv(x)
        q, k, v = self._heads(qkv, b, s)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out, _ = self.linear_proj(self._attend(q, k, v, mask))
        return out

    def forward_flat(self, x: Tensor, fb: _FlatBatch) -> Tensor:
        """Prompts and responses in one flat sequence: every linear layer runs once on all tokens;
        only attention splits them. Response queries see their own prompt's keys and values
        (gathered by ``fb.inverse``, so their gradients add up in the one prompt pass)."""
        qkv, _ = self.linear_qkv(x)
        n_p = fb.u * fb.p
        qp, kp, vp = self._heads(qkv[0, :n_p], fb.u, fb.p)
        qr, kr, vr = self._heads(qkv[0, n_p:], fb.m, fb.r)
        qp, kp = _rope(qp, fb.cos_p, fb.sin_p), _rope(kp, fb.cos_p, fb.sin_p)
        qr, kr = _rope(qr, fb.cos_r, fb.sin_r), _rope(kr, fb.cos_r, fb.sin_r)
        out_p = self._attend(qp, kp, vp, fb.mask_p)
        out_r = self._attend(qr, torch.cat([kp[fb.inverse], kr], dim=2), torch.cat([vp[fb.inverse], vr], dim=2),
                             fb.mask_r)
        out, _ = self.linear_proj(torch.cat([out_p.reshape(1, n_p, -1), out_r.reshape(1, fb.m * fb.r, -1)], dim=1))
        return out


class MLP(nn.Module):
    """SwiGLU; ``linear_fc1`` rows per rank are ``[gate_r; up_r]``."""

    def __init__(self, dims: ModelDims, cfg: ModelParallelConfig):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(dims.hidden_size, 2 * dims.intermediate_size, config=cfg,
                                               init_method=_skip_init, bias=False, gather_output=False)
        self.linear_fc2 = RowParallelLinear(dims.intermediate_size, dims.hidden_size, config=cfg,
                                            init_method=_skip_init, bias=False, input_is_parallel=True,
                                            skip_bias_add=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up, _ = self.linear_fc1(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.linear_fc2(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, cfg: ModelParallelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, cfg.params_dtype)
        self.self_attention = SelfAttention(dims, cfg)
        self.pre_mlp_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, cfg.params_dtype)
        self.mlp = MLP(dims, cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))

    def forward_flat(self, x: Tensor, fb: _FlatBatch) -> Tensor:
        x = x + self.self_attention.forward_flat(self.input_layernorm(x), fb)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Container(nn.Module):
    """Holds submodules only, so parameter names read ``embedding.word_embeddings.weight`` etc."""


def attention_mask_4d(attention_mask: Tensor) -> Tensor:
    """Boolean ``[b, 1, s, s]``: causal, real keys only; the diagonal is always allowed.

    Letting a (left-)padding query see itself keeps its softmax row non-empty, so SDPA never
    yields NaN there (NaN would leak into gradients); real queries never see padding keys.
    """
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.eye(s, dtype=torch.bool, device=attention_mask.device)
    return (causal & keys) | eye


class MegatronCausalLM(nn.Module):
    """Pipeline stage ``pp_rank`` of ``pp`` on one TP rank.

    ``head``: "lm" (vocab-parallel output layer, tied to the embedding when the HF config says so)
    or "value" (critic: replicated ``score`` Linear(hidden, 1) with bias, as HF's
    ``*ForTokenClassification``). With tied embeddings and PP > 1 the last stage owns a copy of the
    embedding as ``output_layer.weight``; the engine all-reduces its gradient with stage 0's.
    """

    def __init__(self, hf_config: Any, dims: ModelDims, cfg: ModelParallelConfig, pp_rank: int,
                 head: str = "lm", gradient_checkpointing: bool = False):
        super().__init__()
        tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        dims.check_parallel(tp, pp)
        self.dims, self.head = dims, head
        self.pre_process, self.post_process = pp_rank == 0, pp_rank == pp - 1
        self.gradient_checkpointing = gradient_checkpointing
        self.rotary = RotaryEmbedding(hf_config, dims.head_dim)
        if self.pre_process:
            self.embedding = _Container()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                dims.vocab_size, dims.hidden_size, init_method=_skip_init, config=cfg)
        self.decoder = _Container()
        self.decoder.layers = nn.ModuleList(DecoderLayer(dims, cfg) for _ in dims.stage_layers(pp, pp_rank))
        if self.post_process:
            self.decoder.final_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, cfg.params_dtype)
            if head == "lm":
                self.share_embedding = dims.tied_embeddings and self.pre_process
                self.output_layer = ColumnParallelLinear(
                    dims.hidden_size, dims.vocab_size, config=cfg, init_method=_skip_init, bias=False,
                    gather_output=False, skip_weight_param_allocation=self.share_embedding)
            elif head == "value":
                self.score = nn.Linear(dims.hidden_size, 1, dtype=cfg.params_dtype)
            else:
                raise ValueError(f"head={head!r} is unknown: use 'lm' or 'value'")

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                hidden: Tensor | None = None, shared: SharedPrompts | None = None) -> Tensor:
        """Stage 0 embeds ``input_ids``; later stages continue from ``hidden`` (the previous
        stage's output). The last stage returns final-normed hidden states ``[b, s, h]``.

        ``shared``: run each distinct prompt once (see SharedPrompts); the output still has one
        row per input row (prompt columns copied from the row's prompt), so the pipeline passes
        the same shapes and each stage shares again from its input."""
        x = self.embedding.word_embeddings(input_ids) if self.pre_process else hidden
        cos, sin = self.rotary(position_ids, x.dtype)
        if shared is not None:
            return self._forward_shared(x, cos, sin, attention_mask_4d(attention_mask), shared)
        # no padding in the micro-batch (packed data, equal-length prompts): causal SDPA, no mask
        mask = None if bool(attention_mask.all()) else attention_mask_4d(attention_mask)
        for layer in self.decoder.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        return self.decoder.final_layernorm(x) if self.post_process else x

    def _forward_shared(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, shared: SharedPrompts) -> Tensor:
        m, s, h = x.shape
        rows, p = shared.first_rows, shared.prompt_cols
        fb = _FlatBatch(u=len(rows), p=p, m=m, r=s - p, cos_p=cos[rows, :p], sin_p=sin[rows, :p],
                        cos_r=cos[:, p:], sin_r=sin[:, p:], mask_p=mask[rows, :, :p, :p], mask_r=mask[:, :, p:],
                        inverse=shared.inverse)
        flat = torch.cat([x[rows, :p].reshape(1, -1, h), x[:, p:].reshape(1, -1, h)], dim=1)
        for layer in self.decoder.layers:
            if self.gradient_checkpointing and self.training:
                flat = torch.utils.checkpoint.checkpoint(layer.forward_flat, flat, fb, use_reentrant=False)
            else:
                flat = layer.forward_flat(flat, fb)
        if self.post_process:
            flat = self.decoder.final_layernorm(flat)
        n_p = fb.u * p
        return torch.cat([flat[0, :n_p].view(fb.u, p, h)[shared.inverse], flat[0, n_p:].view(m, s - p, h)], dim=1)

    def logits(self, hidden: Tensor) -> Tensor:
        """This TP rank's vocabulary slice of the logits, ``[..., V/tp]`` (never gathered)."""
        weight = self.embedding.word_embeddings.weight if self.share_embedding else None
        out, _ = self.output_layer(hidden, weight=weight)
        return out

    def values(self, hidden: Tensor) -> Tensor:
        return self.score(hidden).squeeze(-1)
