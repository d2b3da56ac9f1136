"""Tokenizers with chat templates for the agent tests: the char tokenizer (hybridflow.tiny) under a
simple custom template, one that puts a system prompt first, and Qwen2.5's template (with
<|im_start|>/<|im_end|> added as special tokens); a real Qwen2 tokenizer when the HF cache has one."""
from __future__ import annotations

from hybridflow.tiny import make_char_tokenizer

# roles as tags, every message closed by EOS: the assistant's stop token is the template's closing
CUSTOM = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")

# a system prompt always first (the row's own, or a default), tools listed in it, tool results as "user"
SYSTEM_FIRST = (
    "<s>{% if messages[0].role == 'system' %}[sys]{{ messages[0].content }}{% set rest = messages[1:] %}"
    "{% else %}[sys]You are helpful.{% set rest = messages %}{% endif %}"
    "{% if tools %} tools:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}{{ '\\n' }}"
    "{% for m in rest %}{% if m.role == 'tool' %}[user]result={{ m.content }}{{ '\\n' }}"
    "{% else %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")

# Qwen2.5-Instruct's chat template (Apache-2.0), as shipped in its tokenizer_config.json
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")


def newline_safe_char_tokenizer():
    """hybridflow.tiny's char tokenizer splits on regex ".", which skips newlines, so "\\n\\n" becomes one
    unknown token (<pad>); Qwen's template writes "\\n\\n". Here every character is its own token."""
    from tokenizers import Regex, pre_tokenizers

    tok = make_char_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return tok


def char_tokenizer(template: str):
    tok = newline_safe_char_tokenizer()
    tok.chat_template = template
    return tok


def qwen_style_char_tokenizer():
    """The char tokenizer with Qwen's turn markers as single special tokens and <|im_end|> as EOS."""
    tok = newline_safe_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25
    return tok


def cached_qwen2_tokenizer():
    """A real Qwen2/2.5 instruct tokenizer from the local HF cache, or None (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"):
        if isinstance(try_to_load_from_cache(name, "tokenizer_config.json"), str):  # a cheap look before loading
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(name, local_files_only=True)
            except Exception:
                continue
    return None
