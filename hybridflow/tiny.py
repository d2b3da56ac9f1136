"""Tiny, seeded models and a character tokenizer that need no download.

The demo task (arithmetic), the tests and the benchmarks all build their models here. Sizes
respect vLLM's CPU attention kernels (head_dim 32 works, 16 does not) and keep the vocabulary a
multiple of 64 so every TP size up to 8 divides it.
"""
from __future__ import annotations

import json
import os
import string

import torch

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
VOCAB_MULTIPLE = 64


def char_vocab() -> dict[str, int]:
    tokens = [PAD, BOS, EOS] + list(CHARS)
    n = -(-len(tokens) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    tokens += [f"<unused{i}>" for i in range(n - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens)}


def make_char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character (spaces kept)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=PAD))
    # [\s\S], not ".": the regex engine's "." skips newlines, so "\n\n" stayed one (unknown) piece
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str):
    """Load a tokenizer, working around transformers 5's qwen2 override of custom tokenizers.

    ``AutoTokenizer`` on a folder whose config says qwen2 ignores a saved custom tokenizer.json
    (docs/environment.md); a folder we wrote says ``hybridflow_char: true`` and loads as what it is.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file) as f:
            if json.load(f).get("hybridflow_char"):
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def save_char_tokenizer(path: str):
    tok = make_char_tokenizer()
    tok.save_pretrained(path)
    mark_as_hybridflow_tokenizer(path)
    return tok


def mark_as_hybridflow_tokenizer(path: str) -> None:
    """Tag a saved tokenizer folder so :func:`load_tokenizer` loads it as saved (the qwen2 trap)."""
    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["hybridflow_char"] = True
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)


TINY_ARCHS = ("qwen2", "llama", "qwen3", "mistral")


def tiny_config(arch: str = "qwen2", *, hidden: int = 128, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 256, tied: bool = True,
                vocab_size: int | None = None, max_positions: int = 512, head_dim: int | None = None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    vocab_size = vocab_size or len(char_vocab())
    ids = char_vocab()
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        pad_token_id=ids[PAD], bos_token_id=ids[BOS], eos_token_id=ids[EOS],
        torch_dtype="float32",
    )
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen3":  # a head_dim of its own (default twice hidden/heads), as Qwen3's: q_proj's width != hidden
        return Qwen3Config(**common, rope_theta=10000.0, head_dim=head_dim or 2 * hidden // heads)
    if arch == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    raise ValueError(f"unknown tiny arch {arch!r}: use one of {', '.join(TINY_ARCHS)}")


def make_tiny_checkpoint(path: str, arch: str = "qwen2", seed: int = 0, **config_kwargs) -> str:
    """Write a seeded random HF checkpoint (safetensors) plus the char tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # HF's default init (std 0.02) gives near-uniform logits; a larger std makes tests that compare
    # log-probs or greedy text meaningful (outputs depend on the weights, not on ties).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif "q_norm" in name or "k_norm" in name:  # not all ones, so a mix-up of the two shows
                p.normal_(1.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_char_tokenizer(path)
    return path
