"""A model folder's files, checked before Ray (issue 30): a corrupt config.json or
tokenizer_config.json is one line naming the file (it was a JSON traceback, exit 1), a truncated
safetensors shard is found from its header (it passed and failed a minute later in a worker), and
a folder without tokenizer files is named with the files expected (it was blamed on data row 0)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.config import ConfigError
from hybridflow.model_checks import read_model_config
from hybridflow.model_files import load_model_tokenizer, model_folder_errors, safetensors_error
from hybridflow.config.sft import SFTConfig, load_sft_config, validate_sft
from recipes.cli import compose_config
from tests.hybridflow.config.validate_helpers import TINY_MODEL, error_of, grpo, run_dir  # noqa: F401  (a fixture)

RESTORE = "copy it again from the model's original folder"
ACTOR = "actor_rollout_ref.model.path"


def weights() -> dict:
    return {"embed.weight": torch.zeros(66, 8), "norm.weight": torch.ones(8)}


@pytest.fixture
def model_dir(tmp_path):
    """config.json, the char tokenizer and one intact safetensors shard."""
    from hybridflow.tiny import save_char_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_MODEL))
    save_char_tokenizer(str(folder))
    save_file(weights(), str(folder / "model.safetensors"))
    return folder


def truncate(path, nbytes: int) -> int:
    data = path.read_bytes()
    path.write_bytes(data[:-nbytes])
    return len(data)


def test_an_intact_folder_passes(model_dir):
    assert model_folder_errors(ACTOR, str(model_dir)) == []


def test_a_truncated_shard_is_found_from_its_header(model_dir):
    shard = model_dir / "model.safetensors"
    full = truncate(shard, 100)  # an interrupted copy: the last tensor's bytes are cut
    assert model_folder_errors(ACTOR, str(model_dir)) == [
        f"{ACTOR}: {shard} is truncated: {full - 100} bytes, its header says {full}: {RESTORE} "
        "(an interrupted copy or download leaves this)"]


def test_a_shard_cut_inside_its_header_or_garbled_is_named(model_dir):
    shard = model_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])
    assert "is truncated: 20 bytes, its header alone needs" in safetensors_error(str(shard))
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert safetensors_error(str(shard)).startswith(f"{shard} is not a readable safetensors file (")
    shard.write_bytes(b"oops")
    assert safetensors_error(str(shard)) == (f"{shard} is not a readable safetensors file (4 bytes, too short "
                                             f"for a header): {RESTORE}")


def test_every_shard_of_a_sharded_checkpoint_is_checked_and_the_index_must_hold(model_dir):
    os.remove(model_dir / "model.safetensors")
    for i in (1, 2):
        save_file(weights(), str(model_dir / f"model-0000{i}-of-00002.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    assert model_folder_errors(ACTOR, str(model_dir)) == []
    truncate(model_dir / "model-00002-of-00002.safetensors", 8)
    os.remove(model_dir / "model-00001-of-00002.safetensors")
    errors = model_folder_errors(ACTOR, str(model_dir))
    assert len(errors) == 2
    assert "model-00002-of-00002.safetensors is truncated" in errors[0]
    assert errors[1] == (f"{ACTOR}: {index} names shards that are not in {model_dir}: "
                         f"model-00001-of-00002.safetensors: {RESTORE}")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_validate_names_a_corrupt_json_file_in_one_line(run_dir, name):
    """Through ``validate``, as the entry point calls it: the file, where it breaks, the fix."""
    folder = run_dir / "data/models/tiny-qwen2-sft"
    (folder / name).write_text('{"model_type": "qwen2", "hidden')
    message = error_of(grpo(), available_slots=2)
    assert message == (f"{ACTOR}: {folder / name} is not valid JSON (line 1 column 25: Unterminated string "
                       f"starting at): {RESTORE}")


def test_validate_names_a_truncated_shard(run_dir):
    shard = run_dir / "data/models/tiny-qwen2-sft/model.safetensors"
    save_file(weights(), str(shard))
    truncate(shard, 1)
    assert f"{ACTOR}: {shard} is truncated:" in error_of(grpo(), available_slots=2)


def test_a_non_utf8_config_json_is_named_wherever_it_is_read(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "qwen\xe9"}')
    expected = rf"^{tmp_path}/config.json is not UTF-8 text \(byte 0xe9 at offset 20\): {RESTORE}$"
    with pytest.raises(ConfigError, match=expected):
        read_model_config(str(tmp_path))


def test_sft_validate_names_a_corrupt_config_json(model_dir, tmp_path):
    (model_dir / "config.json").write_text("{")
    overrides = [f"model.path={model_dir}", f"trainer.default_local_dir={tmp_path}/run"]
    cfg = load_sft_config(compose_config("sft", overrides, schema=SFTConfig))
    with pytest.raises(ConfigError) as err:
        validate_sft(cfg)
    assert f"model.path: {model_dir}/config.json is not valid JSON (line 1 column 2: " in str(err.value)


class Model:  # the two keys load_model_tokenizer reads, as a config node has them
    def __init__(self, path, tokenizer_path=None):
        self.path, self.tokenizer_path = str(path), tokenizer_path and str(tokenizer_path)


def test_a_folder_without_tokenizer_files_is_named_with_the_files_expected(model_dir):
    os.remove(model_dir / "tokenizer.json")
    with pytest.raises(ConfigError) as err:
        load_model_tokenizer("actor_rollout_ref.model", Model(model_dir))
    assert str(err.value) == (
        f"{ACTOR}: {model_dir} has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt, "
        "spiece.model, sentencepiece.bpe.model): copy the tokenizer files from the model's original folder "
        "into it, or set actor_rollout_ref.model.tokenizer_path to a folder that has them")


def test_the_tokenizer_comes_from_tokenizer_path_when_set_and_is_named_so(model_dir, tmp_path):
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"^model.tokenizer_path: {empty} has no tokenizer"):
        load_model_tokenizer("model", Model(tmp_path / "anything", empty))
    assert len(load_model_tokenizer("model", Model(tmp_path / "anything", model_dir))) > 60


def test_a_corrupt_tokenizer_config_is_named_when_the_tokenizer_loads(model_dir):
    (model_dir / "tokenizer_config.json").write_text('{"hybridflow_char": tr')
    with pytest.raises(ConfigError, match=rf"^{ACTOR}: {model_dir}/tokenizer_config.json is not valid JSON "
                                          r"\(line 1 column 21: Expecting value\)"):
        load_model_tokenizer("actor_rollout_ref.model", Model(model_dir))
