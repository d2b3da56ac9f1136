"""Data files that cannot be read at all (issue 30): not UTF-8, a truncated or non-parquet
``.parquet``, an empty file. Each is one DataError line naming the file and the fix, the same for
the RL prompt data set and the SFT data set (both read through ``read_rows``), not a decoder's
traceback, and an empty file is called empty, not "filtered to data.max_prompt_length"."""
import json

import pandas as pd
import pytest

from hybridflow.data.dataset import DataError, RLPromptDataset
from hybridflow.data.sft_dataset import SFTDataset

RL_ROW = {"data_source": "arithmetic", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}
SFT_ROW = {"prompt": "1+1=", "response": "2"}


def rl(path, tok):
    return RLPromptDataset(str(path), tok, max_prompt_length=16)


def sft(path, tok):
    return SFTDataset(str(path), tok, max_length=16)


BUILDERS = {"rl": (rl, RL_ROW), "sft": (sft, SFT_ROW)}


def read_error(build, path, tok) -> str:
    with pytest.raises(DataError) as err:
        build(path, tok)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_non_utf8_jsonl_names_its_line_and_the_encoding(tmp_path, char_tokenizer, kind):
    build, row = BUILDERS[kind]
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(row).encode()
    latin1 = good.replace(b"1+1=", b"caf\xe9 1+1=")  # what a Latin-1 editor writes for "cafe" with an accent
    path.write_bytes(good + b"\n" + latin1 + b"\n")
    column = latin1.index(b"\xe9") + 1
    assert read_error(build, path, char_tokenizer).endswith(
        f"latin1.jsonl: line 2 is not UTF-8 text (byte 0xe9 at column {column}): save the file as UTF-8")


@pytest.mark.parametrize("kind", BUILDERS)
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, char_tokenizer, kind):
    build, row = BUILDERS[kind]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n")
    assert len(build(path, char_tokenizer)) == 1


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("damage", ["truncated", "not_parquet"])
def test_an_unreadable_parquet_is_named_with_the_fix(tmp_path, char_tokenizer, kind, damage):
    build, row = BUILDERS[kind]
    path = tmp_path / "d.parquet"
    if damage == "truncated":  # an interrupted copy: the footer is gone
        pd.DataFrame([row] * 8).to_parquet(path, index=False)
        path.write_bytes(path.read_bytes()[:-100])
    else:  # jsonl under a .parquet name
        path.write_text(json.dumps(row) + "\n")
    message = read_error(build, path, char_tokenizer)
    assert message.startswith(f"{path} is not a readable parquet file (Parquet magic bytes not found")
    assert message.endswith("write it again (an interrupted copy truncates it), or give a jsonl file a .jsonl name")


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet", "empty.json"])
def test_an_empty_file_is_called_empty(tmp_path, char_tokenizer, kind, name):
    build, _ = BUILDERS[kind]
    path = tmp_path / name
    path.write_bytes(b"")
    message = read_error(build, path, char_tokenizer)
    assert message == (f"data file {path} is empty (0 bytes): write its rows, or remove it from "
                       "data.train_files / data.val_files")
    assert "max_prompt_length" not in message


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("name", ["blank.jsonl", "no_rows.parquet", "array.json"])
def test_a_file_without_rows_says_so(tmp_path, char_tokenizer, kind, name):
    build, row = BUILDERS[kind]
    path = tmp_path / name
    if name == "blank.jsonl":
        path.write_text("\n  \n")
    elif name == "array.json":
        path.write_text("[]\n")
    else:  # a parquet file with the columns and no rows
        pd.DataFrame([row]).iloc[:0].to_parquet(path, index=False)
    assert read_error(build, path, char_tokenizer) == (
        f"data file {path} has no rows: write its rows, or remove it from data.train_files / data.val_files")


def test_one_empty_file_among_good_ones_is_named(tmp_path, char_tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(RL_ROW) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=f"data file {empty} is empty"):
        RLPromptDataset([str(good), str(empty)], char_tokenizer, max_prompt_length=16)
