"""The HF model a training engine starts from: the role's class (causal LM, or token
classification with one label for a critic), ``model.override_config`` applied (its
``attn_implementation`` as ``from_pretrained`` takes it, as verl does), and the settings that make
its log-probs those of the vLLM policy (no dropout; Gemma-2's softcapped attention)."""
from __future__ import annotations

import torch

from hybridflow.model_overrides import load_hf_config, load_options


def load_hf_model(model_path: str, role: str, overrides: dict | None = None,
                   disable_dropout: bool = True) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = load_hf_config(model_path, overrides)
    if disable_dropout:
        _zero_dropout_settings(config)
    kwargs = attention_choice(config, overrides)
    if role == "critic":  # after the overrides: the value head needs these whatever they say
        config.num_labels = 1
        config.classifier_dropout = 0.0  # the token-classification head otherwise defaults to 0.1
        model = value_model_class(config).from_pretrained(model_path, config=config, dtype=torch.float32, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32, **kwargs)
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model


def attention_choice(config, overrides: dict | None) -> dict:
    """``from_pretrained``'s ``attn_implementation``: the override's when set (eager, sdpa, ...),
    else eager for a model with attention-logit softcapping, else transformers' default (sdpa)."""
    chosen = {k: v for k, v in load_options(overrides).items() if v is not None}
    if chosen:
        return chosen
    # transformers applies Gemma-2's attention-logit softcapping in its eager attention only; vLLM
    # always applies it, so SDPA here would leave the two policies 1e-3 apart in log-prob
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def _zero_dropout_settings(config) -> None:
    """RL trains the policy vLLM samples from, which has no dropout: with it, training forwards
    would score other log-probs than the sampler's (GPT-2's 0.1: rollout_probs_diff 0.04) and the
    PPO ratio would compare two different policies. Zeroes every dropout rate the config holds
    (``attention_dropout``, ``resid_pdrop``, ...), which functional dropouts read."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for key, value in list(vars(cfg).items()):
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
                setattr(cfg, key, 0.0)


def value_model_class(config) -> type:
    """The critic's class: the architecture's ``*ForTokenClassification`` (backbone + a linear score
    per token). transformers registers one for many causal LMs but not all (OLMo2, ...); for those
    the same head is put on the architecture's own backbone, as transformers builds its own (its
    ``GenericForTokenClassification``), where verl falls back to a value-head wrapper. The HF
    export of such a critic names that class, which transformers' Auto classes do not know."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel
    from transformers.modeling_layers import GenericForTokenClassification

    if type(config) in AutoModelForTokenClassification._model_mapping:
        return AutoModelForTokenClassification
    causal = AutoModelForCausalLM._model_mapping[type(config)]
    base = next(c for c in causal.__mro__[1:] if issubclass(c, PreTrainedModel) and c is not PreTrainedModel)
    name = causal.__name__.replace("ForCausalLM", "") + "ForTokenClassification"
    return type(name, (GenericForTokenClassification, base),
                {"base_model_prefix": base.base_model_prefix, "__module__": causal.__module__})
