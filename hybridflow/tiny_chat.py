"""A chat version of ``hybridflow.tiny``'s character tokenizer, for the tool-use demo (issue 37).

The character vocabulary is kept id for id (a model built for the plain char tokenizer reads the
same ids); the chat markers take the vocabulary's unused slots, each one token:

- ``<|im_start|>`` / ``<|im_end|>`` (special: ``skip_special_tokens`` drops them) open and close a
  turn. ``<|im_end|>`` is the EOS: generation stops at the end of each assistant turn.
- ``<tool_call>`` ... ``</tool_call>`` and ``<tool_response>`` ... ``</tool_response>`` (Hermes
  tags, not special: a decoded trajectory keeps them, so a reward can tell the turns apart).

The chat template is ChatML/Hermes-like but compact, because every character is a token:

    <|im_start|>system\\ntools: calc(expression)<|im_end|><|im_start|>user\\n12*3=<|im_end|>
    <|im_start|>assistant\\n<tool_call>{"name":"calc","arguments":{"expression":"12*3"}}</tool_call><|im_end|>
    <|im_start|>tool\\n<tool_response>36</tool_response><|im_end|><|im_start|>assistant\\n36<|im_end|>

(one line in reality: no newline after ``<|im_end|>``, so a generated turn ends exactly at the EOS
the engine stops on and the next turn's tokens follow it with nothing in between). ``tools=``
renders each schema as ``name(param,...)`` in the system turn (:func:`tools_system_text` gives that
text, so SFT traces without ``tools=`` can render the same tokens). An assistant message's
structured ``tool_calls`` render as compact Hermes JSON; consecutive tool messages share one turn.
"""
from __future__ import annotations

import os

from hybridflow.tiny import BOS, EOS, PAD, char_vocab, mark_as_hybridflow_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
SPECIAL = (IM_START, IM_END)  # dropped by decode(skip_special_tokens=True)
TAGS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)  # kept in decoded text
CHAT_TOKENS = SPECIAL + TAGS

# one schema: "name(p1,p2)"; the function object is the schema's "function" (OpenAI form) or the
# schema itself
_TOOL = ("{%- set f = t.function if t.function is defined else t -%}"
         "{{- ' ' ~ f.name ~ '(' ~ ((f.parameters.properties if f.parameters is defined and "
         "f.parameters.properties is defined else {}) | list | join(',')) ~ ')' -}}")
CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}{%- if sys is not none -%}{{- sys ~ '\\n' -}}{%- endif -%}"
    "{{- 'tools:' -}}{%- for t in tools -%}" + _TOOL + "{%- endfor -%}{{- '<|im_end|>' -}}"
    "{%- elif sys is not none -%}{{- '<|im_start|>system\\n' ~ sys ~ '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role == 'system' -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>tool\\n' -}}{%- endif -%}"
    "{{- '<tool_response>' ~ m.content ~ '</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' ~ (m.content or '') -}}"
    "{%- for c in (m.tool_calls or []) -%}{%- set f = c.function if c.function is defined else c -%}"
    "{{- '<tool_call>' ~ ({'name': f.name, 'arguments': (f.arguments | fromjson if f.arguments is string "
    "else f.arguments)} | tojson(separators=(',', ':'))) ~ '</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>' -}}"
    "{%- else -%}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_vocab() -> dict[str, int]:
    """``hybridflow.tiny.char_vocab`` with the chat tokens in its first unused slots."""
    vocab = char_vocab()
    unused = sorted((i for tok, i in vocab.items() if tok.startswith("<unused")))
    if len(unused) < len(CHAT_TOKENS):
        raise ValueError(f"the char vocabulary has {len(unused)} unused slots, {len(CHAT_TOKENS)} needed")
    by_id = {i: tok for tok, i in vocab.items()}
    for tok, i in zip(CHAT_TOKENS, unused):
        by_id[i] = tok
    return {tok: i for i, tok in by_id.items()}


def tools_system_text(tools: list[dict], system: str | None = None) -> str:
    """The system turn's text that ``tools=`` renders: a conversation that carries it as its system
    message renders the same tokens without ``tools=`` (the SFT traces do this)."""
    names = []
    for t in tools:
        f = t.get("function", t)
        names.append(f"{f['name']}({','.join((f.get('parameters') or {}).get('properties') or {})})")
    head = "" if system is None else system + "\n"
    return head + "tools:" + "".join(" " + n for n in names)


def make_chat_tokenizer():
    """A PreTrainedTokenizerFast: one token per character, one per chat marker, the template above."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=chat_vocab(), unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." skips newlines
    tok.decoder = decoders.Fuse()
    # added tokens are matched before the per-character split; they reuse their vocabulary ids
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS, *SPECIAL)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=None, eos_token=IM_END, unk_token=PAD,
        clean_up_tokenization_spaces=False, additional_special_tokens=list(SPECIAL),
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def save_chat_tokenizer(path: str):
    """Save it under ``path`` marked as hybridflow's (``hybridflow.tiny.load_tokenizer`` reads it as saved)."""
    tok = make_chat_tokenizer()
    tok.save_pretrained(path)
    mark_as_hybridflow_tokenizer(path)
    return tok


def make_tiny_chat_checkpoint(path: str, arch: str = "qwen2", seed: int = 0, **config_kwargs) -> str:
    """``hybridflow.tiny.make_tiny_checkpoint`` with the chat tokenizer, and ``<|im_end|>`` as the
    model's EOS (vLLM gets no tokenizer: it stops on the config's EOS ids)."""
    from transformers import AutoConfig, GenerationConfig

    from hybridflow.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(path, arch, seed=seed, **config_kwargs)
    eos = chat_vocab()[IM_END]
    cfg = AutoConfig.from_pretrained(path)
    cfg.eos_token_id = eos
    cfg.bos_token_id = None
    cfg.save_pretrained(path)
    gen_file = os.path.join(path, "generation_config.json")
    gen = GenerationConfig.from_pretrained(path) if os.path.exists(gen_file) else GenerationConfig()
    gen.eos_token_id, gen.bos_token_id, gen.pad_token_id = eos, None, chat_vocab()[PAD]
    gen.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    save_chat_tokenizer(path)
    return path
