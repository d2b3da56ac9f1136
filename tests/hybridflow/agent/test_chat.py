"""hybridflow/agent/chat.py: a tool turn's ids are the template's own rendering of the tool
messages, so prompt + generated ids + tool ids read exactly as the whole conversation templated at
once, under a simple custom template, one that puts a system prompt first, and Qwen2.5's."""
import pytest

from hybridflow.agent.chat import ToolTurnTemplate, encode, prompt_ids, render, truncate_tool_text
from hybridflow.agent.tools.calculator import SCHEMA

from .templates import CUSTOM, SYSTEM_FIRST, cached_qwen2_tokenizer, char_tokenizer, qwen_style_char_tokenizer

TOKENIZERS = {"custom": lambda: char_tokenizer(CUSTOM), "system_first": lambda: char_tokenizer(SYSTEM_FIRST),
              "qwen25": qwen_style_char_tokenizer, "qwen2_cached": cached_qwen2_tokenizer}


@pytest.fixture(params=list(TOKENIZERS))
def tok(request):
    tok = TOKENIZERS[request.param]()
    if tok is None:
        pytest.skip("no Qwen2 tokenizer in the local HF cache")
    return tok


@pytest.mark.parametrize("system", [False, True])
def test_appended_tool_turns_equal_the_whole_conversation_templated_at_once(tok, system):
    messages = ([{"role": "system", "content": "Be brief."}] if system else []) + [{"role": "user", "content": "2+3*4?"}]
    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>', "I got 12. Then 14."]
    results = [["12", "extra"]]
    template = ToolTurnTemplate(tok, [SCHEMA])
    ids = prompt_ids(tok, messages, [SCHEMA])
    conversation = list(messages)
    for i, text in enumerate(turns):
        generated = encode(tok, text) + [tok.eos_token_id]  # the server returns the stop token
        ids += generated
        conversation.append({"role": "assistant", "content": text})
        if i < len(results):
            ids += template.ids(results[i], generated[-1])
            conversation += [{"role": "tool", "content": r} for r in results[i]]
    whole = render(tok, conversation, [SCHEMA], False)
    ours = tok.decode(ids, skip_special_tokens=False)
    # the whole conversation also closes the last assistant turn; the trajectory ends at its stop token
    assert whole.startswith(ours) and whole[len(ours):] == "\n"  # the closing after the stop token
    assert encode(tok, whole)[: len(ids)] == ids


def test_a_system_prompt_the_template_adds_appears_once(tok):
    template = ToolTurnTemplate(tok, [SCHEMA])
    text = template.turn_text([{"role": "tool", "content": "7"}])
    assert "7" in text and "system" not in text and "[sys]" not in text


def test_a_stop_token_other_than_the_closing_keeps_the_whole_closing():
    tok = char_tokenizer(CUSTOM)
    template = ToolTurnTemplate(tok, None)
    assert tok.decode(template.ids(["5"], tok.eos_token_id)) == "\n<tool>5</s>\n<assistant>"
    assert tok.decode(template.ids(["5"], tok.encode("!")[0])) == "</s>\n<tool>5</s>\n<assistant>"


def test_a_template_that_drops_assistant_content_is_refused_at_construction():
    tok = char_tokenizer("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="does not write an assistant message's content"):
        ToolTurnTemplate(tok, None)


def test_a_template_that_refuses_tool_messages_is_refused_at_construction():
    tok = char_tokenizer("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
                         "{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot render a tool message after an assistant message.*no tools here"):
        ToolTurnTemplate(tok, None)


# Qwen3-like: the last assistant message gets an empty think block, earlier ones do not, so the
# conversation up to the assistant is not a prefix of the conversation with the tool turn after it
THINK_WHEN_LAST = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and loop.last %}<think></think>"
                   "{% endif %}{{ m.content }}</s>{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_renders_earlier_turns_by_what_follows_still_gives_the_tool_turn():
    tok = char_tokenizer(THINK_WHEN_LAST)
    assert tok.decode(ToolTurnTemplate(tok, None).ids(["7"], tok.eos_token_id)) == "\n<tool>7</s>\n<assistant>"


@pytest.mark.parametrize("side, expected", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                            ("middle", "ab...(truncated)...ij")])
def test_truncation_sides(side, expected):
    assert truncate_tool_text("abcdefghij", 4, side) == expected
    assert truncate_tool_text("abcd", 4, side) == "abcd"
