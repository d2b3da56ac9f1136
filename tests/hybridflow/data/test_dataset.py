import copy
import json
import logging

import pandas as pd
import pytest
import torch

from hybridflow.data.dataset import DataError, RLPromptDataset, encode_prompt

ROWS = [
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "12+7="}],
     "reward_model": {"ground_truth": "19"}, "extra_info": {"index": 0}},
    {"data_source": "arithmetic", "prompt": [{"role": "system", "content": "add"},
                                             {"role": "user", "content": "3+4="}],
     "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 1}},
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "100+200="}],
     "reward_model": {"ground_truth": "300"}, "extra_info": {"index": 2}},
]


def write(rows, path):
    if str(path).endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path, index=False)
    else:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return str(path)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_chat_rows_without_template_join_message_contents(tmp_path, char_tokenizer, ext):
    path = write(ROWS, tmp_path / f"d.{ext}")
    ds = RLPromptDataset(path, char_tokenizer, max_prompt_length=12)
    assert len(ds) == 3
    item = ds[1]
    expected = ids_of(char_tokenizer, "add\n3+4=")
    assert item["input_ids"][-len(expected):].tolist() == expected
    assert item["data_source"] == "arithmetic" and item["ground_truth"] == "7"
    assert item["extra_info"] == {"index": 1}
    assert item["raw_prompt"] == ROWS[1]["prompt"]


def test_joining_chat_messages_without_a_template_is_warned_unless_asked_for(tmp_path, char_tokenizer, caplog):
    """verl would fail on chat messages and a tokenizer without a template; here they are joined,
    which silently changes what a model trained with a template sees: say so once."""
    path = write(ROWS, tmp_path / "d.jsonl")
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        RLPromptDataset(path, char_tokenizer, max_prompt_length=12)
    assert "3 prompts of" in caplog.text and "no chat_template: their contents were joined by newlines" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        RLPromptDataset(path, char_tokenizer, max_prompt_length=12, apply_chat_template=False)
    assert "chat_template" not in caplog.text


def test_parquet_and_jsonl_give_identical_items(tmp_path, char_tokenizer):
    a = RLPromptDataset(write(ROWS, tmp_path / "d.parquet"), char_tokenizer, max_prompt_length=12)
    b = RLPromptDataset(write(ROWS, tmp_path / "d.jsonl"), char_tokenizer, max_prompt_length=12)
    for i in range(3):
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert torch.equal(a[i][key], b[i][key])
        assert a[i]["ground_truth"] == b[i]["ground_truth"]
        assert a[i]["raw_prompt"] == b[i]["raw_prompt"]


def test_plain_string_prompt_is_used_verbatim_and_list_of_files_concatenates(tmp_path, char_tokenizer):
    rows = [{"data_source": "raw", "prompt": "Q: 5-2=", "reward_model": {"ground_truth": "3"}}]
    ds = RLPromptDataset([write(ROWS, tmp_path / "a.jsonl"), write(rows, tmp_path / "b.parquet")],
                         char_tokenizer, max_prompt_length=12)
    assert len(ds) == 4
    item = ds[3]
    n = len("Q: 5-2=")
    assert item["input_ids"][-n:].tolist() == ids_of(char_tokenizer, "Q: 5-2=")
    assert item["attention_mask"].sum() == n
    assert item["extra_info"] == {}  # absent column -> empty dict
    assert item["data_source"] == "raw"


def test_chat_template_applied_with_generation_prompt(tmp_path, char_tokenizer):
    tok = copy.deepcopy(char_tokenizer)  # keep the session fixture template-free
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    ds = RLPromptDataset(write(ROWS[:1], tmp_path / "d.jsonl"), tok, max_prompt_length=16)
    expected = ids_of(tok, "<user>12+7=<a>")
    assert ds[0]["input_ids"][-len(expected):].tolist() == expected
    assert ds[0]["attention_mask"].sum() == len(expected)
    # a plain string is raw text unless data.apply_chat_template=true asks: then one user message
    assert encode_prompt(tok, "12+7=") == ids_of(tok, "12+7=")
    assert encode_prompt(tok, "12+7=", apply_chat_template=True) == ids_of(tok, "<user>12+7=<a>")
    with pytest.raises(DataError, match="data.apply_chat_template=True but the tokenizer has no chat_template"):
        encode_prompt(char_tokenizer, "12+7=", apply_chat_template=True)
    # data.apply_chat_template_kwargs reach the template's own variables (Qwen3's enable_thinking)
    tok.chat_template = tok.chat_template.replace("<a>", "<a>{% if not think %}=={% endif %}")
    ds = RLPromptDataset.from_config(write(ROWS[:1], tmp_path / "d.jsonl"), tok, {
        "max_prompt_length": 16, "apply_chat_template_kwargs": {"think": False}})
    expected = ids_of(tok, "<user>12+7=<a>==")
    assert ds[0]["input_ids"][-len(expected):].tolist() == expected


def test_left_padding_mask_and_position_ids(tmp_path, char_tokenizer):
    ds = RLPromptDataset(write(ROWS[:1], tmp_path / "d.jsonl"), char_tokenizer, max_prompt_length=8)
    item = ds[0]
    pad = char_tokenizer.pad_token_id
    assert item["input_ids"].tolist() == [pad] * 3 + ids_of(char_tokenizer, "12+7=")
    assert item["attention_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert item["input_ids"].dtype == torch.long


def test_overlong_prompts_are_filtered_with_a_logged_count(tmp_path, char_tokenizer, caplog):
    path = write(ROWS, tmp_path / "d.jsonl")
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLPromptDataset(path, char_tokenizer, max_prompt_length=7, filter_overlong_prompts=True)
    # "add\n3+4=" is 8 tokens and "100+200=" is 8 tokens: both dropped, "12+7=" kept
    assert len(ds) == 1 and ds.num_filtered == 2
    assert ds[0]["ground_truth"] == "19"
    assert "dropped 2 of 3 prompts" in caplog.text


def test_overlong_prompt_without_filter_is_an_error_naming_row_and_key(tmp_path, char_tokenizer):
    path = write(ROWS, tmp_path / "d.jsonl")
    with pytest.raises(ValueError) as err:
        RLPromptDataset(path, char_tokenizer, max_prompt_length=7, filter_overlong_prompts=False)
    msg = str(err.value)
    assert path in msg and "row 1" in msg and "'prompt'" in msg and "8 tokens" in msg
    assert "max_prompt_length=7" in msg


@pytest.mark.parametrize("side,expected", [("left", "00+200="), ("right", "100+200")])
def test_truncation_only_when_asked_and_counted(tmp_path, char_tokenizer, side, expected, caplog):
    path = write(ROWS[2:], tmp_path / "d.jsonl")
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLPromptDataset(path, char_tokenizer, max_prompt_length=7,
                             filter_overlong_prompts=False, truncation=side)
    assert ds.num_truncated == 1 and "truncated 1 prompts" in caplog.text
    assert ds[0]["input_ids"].tolist() == ids_of(char_tokenizer, expected)


@pytest.mark.parametrize("mutate,key", [
    (lambda r: r.pop("reward_model"), "reward_model"),
    (lambda r: r.pop("prompt"), "prompt"),
    (lambda r: r.__setitem__("prompt", 42), "prompt"),
    (lambda r: r.__setitem__("prompt", [{"role": "user"}]), "prompt"),
    (lambda r: r.__setitem__("reward_model", {"style": "rule"}), "reward_model"),
    (lambda r: r.__setitem__("extra_info", "x"), "extra_info"),
    (lambda r: r.__setitem__("data_source", 3), "data_source"),
])
def test_bad_row_error_names_file_row_and_key(tmp_path, char_tokenizer, mutate, key):
    rows = json.loads(json.dumps(ROWS))
    mutate(rows[2])
    path = write(rows, tmp_path / "bad.jsonl")
    with pytest.raises(ValueError) as err:
        RLPromptDataset(path, char_tokenizer, max_prompt_length=16)
    msg = str(err.value)
    assert path in msg and "row 2" in msg and repr(key) in msg


def test_custom_prompt_key_and_from_config(tmp_path, char_tokenizer):
    rows = [{"data_source": "d", "question": "1+1=", "reward_model": {"ground_truth": "2"}}]
    path = write(rows, tmp_path / "d.parquet")
    ds = RLPromptDataset.from_config(path, char_tokenizer, {"prompt_key": "question", "max_prompt_length": 6})
    assert ds[0]["input_ids"].shape == (6,) and ds[0]["raw_prompt"] == "1+1="
    with pytest.raises(ValueError, match="row 0: key 'prompt' is missing"):
        RLPromptDataset(path, char_tokenizer, max_prompt_length=6)


def test_bad_settings_and_files_fail_clearly(tmp_path, char_tokenizer):
    path = write(ROWS, tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="data.truncation"):
        RLPromptDataset(path, char_tokenizer, truncation="middle")
    with pytest.raises(DataError, match="nope.parquet"):
        RLPromptDataset(str(tmp_path / "nope.parquet"), char_tokenizer)
    with pytest.raises(ValueError, match="unsupported extension"):
        RLPromptDataset(write(ROWS, tmp_path / "d.csv"), char_tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        RLPromptDataset(str(tmp_path / "broken.jsonl"), char_tokenizer)
    with pytest.raises(ValueError, match="no prompts left"):
        RLPromptDataset(path, char_tokenizer, max_prompt_length=2)


def test_a_json_array_file_reads_like_jsonl(tmp_path, char_tokenizer):
    """``.json`` holding one array of rows (what json.dump writes) reads the same as one row per line."""
    array = tmp_path / "d.json"
    array.write_text(json.dumps(ROWS, indent=2))
    a = RLPromptDataset(str(array), char_tokenizer, max_prompt_length=12)
    b = RLPromptDataset(write(ROWS, tmp_path / "d.jsonl"), char_tokenizer, max_prompt_length=12)
    assert len(a) == len(b) == 3
    for i in range(3):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and a[i]["ground_truth"] == b[i]["ground_truth"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(ROWS, indent=2)[:-3])
    with pytest.raises(DataError, match="broken.json: line .* is not valid JSON"):
        RLPromptDataset(str(broken), char_tokenizer, max_prompt_length=12)


def test_max_samples_keeps_the_first_kept_rows_across_files(tmp_path, char_tokenizer):
    """data.train_max_samples / val_max_samples: the first N rows that pass the length filter,
    reading no further (a quick run on a large file)."""
    first, second = write(ROWS, tmp_path / "a.jsonl"), write(ROWS, tmp_path / "b.parquet")
    ds = RLPromptDataset([first, second], char_tokenizer, max_prompt_length=7, max_samples=2)
    assert [ds[i]["ground_truth"] for i in range(len(ds))] == ["19", "19"]  # one kept row per file
    assert ds.num_filtered == 2  # the second file stopped after its first row
    assert len(RLPromptDataset([first, second], char_tokenizer, max_prompt_length=12, max_samples=4)) == 4
    assert len(RLPromptDataset.from_config(first, char_tokenizer, {"max_prompt_length": 12}, max_samples=-1)) == 3


def test_reward_fn_key_names_the_column_that_picks_the_reward_function(tmp_path, char_tokenizer):
    """verl's data.reward_fn_key: the column passed on as data_source; a row without it is named."""
    rows = [{"ability": "math", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    ds = RLPromptDataset.from_config(write(rows, tmp_path / "a.jsonl"), char_tokenizer,
                                     {"max_prompt_length": 8, "reward_fn_key": "ability"})
    assert ds[0]["data_source"] == "math"
    with pytest.raises(DataError, match="row 0: key 'data_source'"):
        RLPromptDataset(write(rows, tmp_path / "b.jsonl"), char_tokenizer, max_prompt_length=8)


def test_an_empty_prompt_is_an_error_naming_the_row(tmp_path, char_tokenizer):
    rows = [ROWS[0], {"data_source": "raw", "prompt": "", "reward_model": {"ground_truth": "3"}}]
    with pytest.raises(DataError, match=r"d.jsonl: row 1: key 'prompt' is '', which tokenizes to no tokens"):
        RLPromptDataset(write(rows, tmp_path / "d.jsonl"), char_tokenizer, max_prompt_length=12)
