"""SFT pairs: each row's prompt + response within data.max_length on its own (one long prompt
does not squeeze every other row's response), truncation only when asked, the layout the RL
engine's response log-prob reads."""
import logging

import pandas as pd
import pytest
import torch

from hybridflow.data.dataset import DataError
from hybridflow.data.sft_dataset import SFTDataset, collate_sft

LONG_PROMPT = "What is 123456789 + 987654321, please?"  # 38 characters: one token each


def write(tmp_path, pairs, name="sft.parquet"):
    path = str(tmp_path / name)
    pd.DataFrame([{"prompt": p, "response": r} for p, r in pairs]).to_parquet(path, index=False)
    return path


def test_rows_fit_max_length_on_their_own(tmp_path, char_tokenizer):
    # row 0: 38 + 3 (+EOS) tokens, row 1: 5 + 20 (+EOS): each fits 48, their longest parts do not
    path = write(tmp_path, [(LONG_PROMPT, "abc"), ("1+2=?", "x" * 20)])
    ds = SFTDataset(path, char_tokenizer, max_length=48)
    assert (ds.prompt_length, ds.response_length, ds.truncated) == (38, 21, 0)
    batch = collate_sft([ds[0], ds[1]])
    eos = char_tokenizer.eos_token_id
    assert batch["response_mask"].sum(-1).tolist() == [4, 21]
    assert batch["responses"][1, :21].tolist() == char_tokenizer("x" * 20)["input_ids"] + [eos]
    assert batch["attention_mask"].sum(-1).tolist() == [42, 26]
    assert (batch["position_ids"].max(-1).values < 48).all()  # no row goes past the model's length


def test_overlong_row_is_an_error_naming_the_row_unless_truncation_asks(tmp_path, char_tokenizer, caplog):
    path = write(tmp_path, [("1+2=?", "3"), (LONG_PROMPT, "x" * 20)])
    with pytest.raises(DataError, match=r"sft.parquet: row 1: prompt\+response is 59 tokens, longer than "
                                        r"data.max_length=48: raise data.max_length or set data.truncation"):
        SFTDataset(path, char_tokenizer, max_length=48)
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.sft_dataset"):
        left = SFTDataset(path, char_tokenizer, max_length=48, truncation="left")
    assert "1 of 2 rows truncated" in caplog.text
    assert left.rows[1][0] == char_tokenizer(LONG_PROMPT[11:])["input_ids"]  # the prompt's head dropped
    right = SFTDataset(path, char_tokenizer, max_length=48, truncation="right")
    assert right.rows[1][1] == char_tokenizer("x" * 10)["input_ids"]  # the response's tail (and EOS) dropped
    assert left.rows[0] == right.rows[0]  # rows that fit are untouched
    with pytest.raises(DataError, match="the prompt alone leaves no room"):
        SFTDataset(path, char_tokenizer, max_length=38, truncation="right")


def test_string_prompts_are_templated_when_asked(tmp_path, char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a>"
    path = write(tmp_path, [("1+2=?", "3")])
    raw, templated = (SFTDataset(path, tok, max_length=32, apply_chat_template=flag).rows[0][0]
                      for flag in (None, True))
    assert raw == tok("1+2=?")["input_ids"]
    assert templated == tok("<user>1+2=?<a>", add_special_tokens=False)["input_ids"]
    assert torch.tensor(templated).numel() == len("<user>1+2=?<a>")


CHATML = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")
CONVERSATION = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "+4"},
                {"role": "assistant", "content": "7"}]


def _chat_tokenizer(char_tokenizer, template=CHATML):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = template
    return tok


def test_multiturn_rows_train_on_every_assistant_turn(tmp_path, char_tokenizer):
    tok = _chat_tokenizer(char_tokenizer)
    path = str(tmp_path / "chat.parquet")
    pd.DataFrame([{"messages": CONVERSATION}]).to_parquet(path, index=False)
    ds = SFTDataset(path, tok, max_length=64, messages_key="messages")
    item = ds[0]
    text = tok.decode(item["input_ids"][item["attention_mask"].bool()].tolist())
    assert text == "<system>add|<user>1+2|<assistant>3|<user>+4|<assistant>7|"
    assert tok.decode(item["input_ids"][:ds.prompt_length][-len("<assistant>"):].tolist()) == "<assistant>"
    # the loss covers each assistant answer and its end-of-turn marker, nothing of the user's turns
    targets = item["responses"][item["response_mask"].bool()].tolist()
    assert tok.decode(targets) == "3|7|"
    opens = str(tmp_path / "opens.parquet")
    pd.DataFrame([{"messages": CONVERSATION[2:]}]).to_parquet(opens, index=False)
    with pytest.raises(DataError, match="row 0: the conversation opens with an assistant turn"):
        SFTDataset(opens, tok, max_length=64, messages_key="messages")
    with pytest.raises(DataError, match="row 0: missing key 'turns'"):
        SFTDataset(path, tok, max_length=64, messages_key="turns")


def test_multiturn_needs_an_assistant_turn_and_a_prefix_stable_template(tmp_path, char_tokenizer):
    path = str(tmp_path / "chat.parquet")
    pd.DataFrame([{"messages": CONVERSATION[:2]}]).to_parquet(path, index=False)
    with pytest.raises(DataError, match="no assistant message to train on"):
        SFTDataset(path, _chat_tokenizer(char_tokenizer), max_length=64, messages_key="messages")
    pd.DataFrame([{"messages": CONVERSATION}]).to_parquet(path, index=False)
    last_only = "{% for m in messages %}{% if loop.last %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="does not render turn 2 as a prefix"):
        SFTDataset(path, _chat_tokenizer(char_tokenizer, last_only), max_length=64, messages_key="messages")
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        SFTDataset(path, char_tokenizer, max_length=64, messages_key="messages")


def test_prompt_and_response_inside_a_dict_column(tmp_path, char_tokenizer):
    # verl's GSM8K SFT layout: data.prompt_key=extra_info data.prompt_dict_keys=[question]
    path = str(tmp_path / "gsm.parquet")
    pd.DataFrame([{"extra_info": {"question": "1+2=?", "answer": "3"}}]).to_parquet(path, index=False)
    ds = SFTDataset(path, char_tokenizer, max_length=32, prompt_key="extra_info", response_key="extra_info",
                    prompt_dict_keys=["question"], response_dict_keys=["answer"])
    prompt, response, _ = ds.rows[0]
    assert prompt == char_tokenizer("1+2=?")["input_ids"]
    assert response == char_tokenizer("3")["input_ids"] + [char_tokenizer.eos_token_id]
    with pytest.raises(DataError, match=r"row 0: missing key 'extra_info.query'"):
        SFTDataset(path, char_tokenizer, max_length=32, prompt_key="extra_info", prompt_dict_keys=["query"])
