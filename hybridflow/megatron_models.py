"""Which HF decoders the Megatron engine builds, read from a config.json (a dict or an HF config).

The engine's model (``workers/models/transformer.py``) is the Llama block: RMSNorm, RoPE, GQA,
SwiGLU. The families below are that block with at most these differences: Qwen2 adds a q/k/v
bias, Qwen3 a per-head RMSNorm on queries and keys (and a ``head_dim`` of its own), Mistral
nothing as long as its sliding window covers every position. This lives in the core, not in
``workers/``, so the config check refuses an unsupported model before any worker starts.
"""
from __future__ import annotations

from typing import Any

ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "mistral": "MistralForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCH_BY_MODEL_TYPE.values())
QKV_BIAS = ("Qwen2ForCausalLM",)  # always, whatever attention_bias says
QK_NORM = ("Qwen3ForCausalLM",)


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def architecture(cfg: Any) -> str:
    """The causal-LM class name; a saved critic (``*ForTokenClassification``) has the same backbone."""
    archs = config_value(cfg, "architectures") or []
    arch = archs[0] if archs else ARCH_BY_MODEL_TYPE.get(config_value(cfg, "model_type"), "")
    return arch.replace("ForTokenClassification", "ForCausalLM")


def unsupported_reason(cfg: Any) -> str | None:
    """None when the engine builds this model; otherwise one line saying why not and what to do."""
    arch = architecture(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        return (f"model architecture {arch or config_value(cfg, 'model_type')!r} is not supported by the "
                f"megatron engine: use one of {', '.join(SUPPORTED_ARCHITECTURES)} (or strategy=fsdp)")
    if arch not in QKV_BIAS and (config_value(cfg, "attention_bias") or config_value(cfg, "mlp_bias")):
        return (f"{arch} with attention_bias/mlp_bias=true is not supported by the megatron engine: "
                "use strategy=fsdp for this checkpoint")
    if config_value(cfg, "use_sliding_window"):
        return ("use_sliding_window=true is not supported by the megatron engine: "
                "set use_sliding_window=false in config.json or use strategy=fsdp")
    window, positions = config_value(cfg, "sliding_window"), config_value(cfg, "max_position_embeddings")
    if arch == "MistralForCausalLM" and window is not None and (positions is None or window < positions):
        # Qwen2/3 carry a sliding_window too, but only use_sliding_window turns it on
        return (f"MistralForCausalLM with sliding_window={window} (below max_position_embeddings={positions}) "
                "is not supported by the megatron engine: set sliding_window to null in config.json if "
                "sequences stay shorter than it, or use strategy=fsdp")
    return None
