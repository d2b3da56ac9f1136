"""What the planner plans for: model shapes and one PPO step's batch (HybridFlow section 6 inputs).

A ``ModelShape`` is a decoder-only transformer (Llama layout: GQA attention, SwiGLU MLP, RMSNorm,
untied embeddings unless ``tied``; Qwen2's Q/K/V biases and Qwen3's per-head Q/K norms where the
model has them); its parameter count is exact for that layout, so the catalog's counts match the
published checkpoints (Llama-2 7B: 6.74e9, 13B: 13.0e9, 70B: 69.0e9; CodeLlama
34B: 33.7e9). A ``Workload`` is one PPO iteration: ``prompts x samples_per_prompt`` sequences of
``prompt_len + response_len`` tokens, trained ``ppo_epochs`` times in ``mini_batches`` updates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder. ``ffn`` is the SwiGLU intermediate size (three matrices).

    ``head_dim`` is each attention head's width; 0 means the textbook ``hidden // heads``. Models
    whose config sets it apart from that (Qwen3-0.6B: 16 heads of 128 in a 1024-wide model, Gemma)
    have Q/O projections of ``heads x head_dim`` and a KV cache of ``kv_heads x head_dim`` a layer,
    so counting ``hidden // heads`` there halves both.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False  # Qwen2's Q/K/V projections carry biases
    head_dim: int = 0
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's Q and K (head_dim weights each)

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention output: ``hidden`` unless ``head_dim`` is set apart."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Q and O (h x q_dim each), K and V (h x kv_dim each), gate/up/down (3 h x ffn), two norms
        (and Q/K/V biases, Q/K head norms where the model has them)."""
        h = self.hidden
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.ffn + 2 * h + bias + qk_norm

    @property
    def embedding_params(self) -> int:
        """Input embedding, plus the LM head unless tied, plus the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (GQA stores kv_heads, not heads)."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, hf_config: Any, name: str | None = None) -> "ModelShape":
        """From a transformers ``PretrainedConfig`` or its ``config.json`` dict (Llama/Qwen/Mistral
        keys; a multimodal config's ``text_config``)."""
        if isinstance(hf_config, Mapping):
            text = hf_config.get("text_config") or hf_config
        else:
            text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        get, outer_get = _getter(text), _getter(hf_config)
        heads = int(get("num_attention_heads"))
        model_type = get("model_type", "") or ""
        tied = get("tie_word_embeddings", None)
        if tied is None:  # a multimodal config may keep it on the outer config
            tied = outer_get("tie_word_embeddings", False)
        return cls(name=name or str(outer_get("_name_or_path", None) or outer_get("model_type", "model")),
                   hidden=int(get("hidden_size")), layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads", None) or heads),
                   ffn=int(get("intermediate_size")), vocab=int(get("vocab_size")),
                   tied=bool(tied),
                   qkv_bias=bool(get("attention_bias", False)) or model_type.startswith("qwen2"),
                   head_dim=int(get("head_dim", None) or 0),
                   qk_norm=model_type.startswith("qwen3"))


def _getter(config: Any):
    """``get(key, default)`` on a config.json dict or a ``PretrainedConfig``."""
    return config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)


# Public shapes, from each checkpoint's config.json: Llama-2 (Touvron et al. 2023, arXiv:2307.09288,
# table 1 + meta-llama/Llama-2-{7,13,70}b-hf) and Code Llama 34B (arXiv:2308.12950, codellama/CodeLlama-34b-hf).
# HybridFlow's evaluation (section 8.1) runs Llama-2 7B/13B/34B/70B; Llama-2 34B was never released,
# so its public 34B stand-in here is Code Llama 34B (same family, GQA with 8 KV heads).
CATALOG: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
    "codellama-34b": ModelShape("codellama-34b", 8192, 48, 64, 8, 22016, 32000),
    "llama-2-70b": ModelShape("llama-2-70b", 8192, 80, 64, 8, 28672, 32000),
}
ALIASES = {"7b": "llama-2-7b", "13b": "llama-2-13b", "34b": "codellama-34b", "70b": "llama-2-70b"}


def model_by_name(name: str) -> ModelShape:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG:
        raise KeyError(f"unknown model {name!r}: one of {sorted(ALIASES) + sorted(CATALOG)}")
    return CATALOG[key]


@dataclass(frozen=True)
class Workload:
    """One PPO iteration. ``reference``: a frozen copy of the actor computes reference log-probs.

    ``micro_batch`` is sequences per device per forward/backward (verl's
    ``ppo_micro_batch_size_per_gpu``); ``recompute`` is activation checkpointing (verl's
    ``enable_gradient_checkpointing``); ``param_bytes`` the training/rollout dtype's width (bf16 = 2).
    ``one_step_off``: a plan with a rollout pool of its own generates the next batch while this one
    trains (verl's one-step-off policy, ``async_training.staleness_threshold=1``: off-policy by a
    step, so it is opt-in); False (default): the pools take turns (staleness 0, on-policy, the
    same algorithm as the colocated plans). ``old_log_prob``: the actor recomputes pi_old after
    generation (False where the run skips it: strictly on policy, or the sampler's log-probs used).
    """

    actor: ModelShape
    critic: ModelShape | None = None
    reference: bool = True
    reward_model: ModelShape | None = None
    prompts: int = 1024
    samples_per_prompt: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    ppo_epochs: int = 1
    mini_batches: int = 1
    param_bytes: int = 2
    optimizer: str = "adam"
    micro_batch: int = 2
    recompute: bool = True
    one_step_off: bool = False
    old_log_prob: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    def model_of(self, role: str) -> ModelShape:
        """The shape behind a role: actor, rollout and ref share the actor's."""
        if role in ("actor", "rollout", "ref"):
            return self.actor
        shape = {"critic": self.critic, "reward_model": self.reward_model}.get(role)
        if shape is None:
            raise KeyError(f"workload has no {role}")
        return shape

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles with a model on devices (``rollout`` is the actor's generation layout)."""
        out = ["actor"]
        if self.reference:
            out.append("ref")
        if self.critic is not None:
            out.append("critic")
        if self.reward_model is not None:
            out.append("reward_model")
        return tuple(out)
