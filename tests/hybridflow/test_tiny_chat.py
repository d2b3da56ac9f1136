"""The demo's chat tokenizer: chat markers are single tokens in the char vocabulary's spare slots, the
template renders a tool conversation compactly, and a saved checkpoint loads back as saved."""
import json

import pytest

from hybridflow.tiny import char_vocab, load_tokenizer
from hybridflow.tiny_chat import (CHAT_TOKENS, IM_END, make_chat_tokenizer, make_tiny_chat_checkpoint,
                                  tools_system_text)

SCHEMA = {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALL = '<tool_call>{"name":"calc","arguments":{"expression":"12*3"}}</tool_call>'
CONVERSATION = [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"}]


@pytest.fixture(scope="module")
def tok():
    return make_chat_tokenizer()


def ids_of(tok, *args, **kwargs):
    out = tok.apply_chat_template(*args, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_tokens_are_one_id_each_and_characters_keep_their_ids(tok):
    chars = {t: i for t, i in char_vocab().items() if not t.startswith("<unused")}
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in chars.items())
    ids = [tok.convert_tokens_to_ids(t) for t in CHAT_TOKENS]
    assert len(set(ids)) == len(CHAT_TOKENS) and min(ids) >= len(chars) and max(ids) < len(char_vocab())
    text = "a\n\nb " + "".join(CHAT_TOKENS)
    assert tok.encode(text, add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "a\n\nb "] + ids
    assert tok.eos_token == IM_END


def test_template_renders_tools_calls_and_responses_compactly(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=[SCHEMA], tokenize=False)
    assert text == ("<|im_start|>system\ntools: calc(expression)<|im_end|><|im_start|>user\n12*3=<|im_end|>"
                    f"<|im_start|>assistant\n{CALL}<|im_end|><|im_start|>tool\n<tool_response>36</tool_response>"
                    "<|im_end|><|im_start|>assistant\n36<|im_end|>")
    # decoding for a reward drops the turn markers, keeps the Hermes tags
    decoded = tok.decode(ids_of(tok, CONVERSATION, tools=[SCHEMA]), skip_special_tokens=True)
    assert "<|im_end|>" not in decoded and CALL in decoded and "<tool_response>36</tool_response>" in decoded


def test_structured_tool_calls_render_as_the_same_hermes_text(tok):
    structured = [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "12*3"}}}]}]
    assert (tok.apply_chat_template(structured, tokenize=False)
            == tok.apply_chat_template(CONVERSATION[:2], tokenize=False))


def test_tools_system_text_renders_the_same_tokens_as_tools(tok):
    """The SFT traces carry the tools as a system message; RL prompts get them through tools=."""
    as_system = [{"role": "system", "content": tools_system_text([SCHEMA])}, *CONVERSATION]
    assert ids_of(tok, as_system) == ids_of(tok, CONVERSATION, tools=[SCHEMA])
    with_system = [{"role": "system", "content": "be brief"}, *CONVERSATION]
    assert (ids_of(tok, [{"role": "system", "content": tools_system_text([SCHEMA], "be brief")}, *CONVERSATION])
            == ids_of(tok, with_system, tools=[SCHEMA]))


def test_each_turn_is_a_prefix_of_the_next_and_ends_at_eos(tok):
    """Tokens in, tokens out: a generated turn ends at <|im_end|> (the EOS the engine stops on) and
    the tool turn's tokens follow it directly."""
    eos = tok.eos_token_id
    for i in range(1, len(CONVERSATION)):
        head = ids_of(tok, CONVERSATION[:i], tools=[SCHEMA])
        assert ids_of(tok, CONVERSATION[:i + 1], tools=[SCHEMA])[:len(head)] == head
        assert head[-1] == eos
    prompt = ids_of(tok, CONVERSATION[:1], tools=[SCHEMA], add_generation_prompt=True)
    assert ids_of(tok, CONVERSATION[:2], tools=[SCHEMA])[:len(prompt)] == prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_loads_its_tokenizer_and_stops_on_im_end(tmp_path, arch):
    path = make_tiny_chat_checkpoint(str(tmp_path), arch, hidden=64, layers=1, heads=2, kv_heads=1,
                                     intermediate=64)
    tok = load_tokenizer(path)
    assert tok.apply_chat_template(CONVERSATION, tools=[SCHEMA], tokenize=False) == \
        make_chat_tokenizer().apply_chat_template(CONVERSATION, tools=[SCHEMA], tokenize=False)
    for name in ("config.json", "generation_config.json"):
        with open(f"{path}/{name}") as f:
            assert json.load(f)["eos_token_id"] == tok.convert_tokens_to_ids(IM_END)
    if arch == "llama":  # transformers' own loader reads a Llama folder's saved tokenizer as saved
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(path)
        assert auto.encode("a b\n" + CALL, add_special_tokens=False) == tok.encode("a b\n" + CALL,
                                                                                  add_special_tokens=False)
