"""Text rows of generated batches and their files: trainer.log_val_generations,
trainer.rollout_data_dir and trainer.validation_data_dir (hybridflow/trainer/generations.py)."""
import json
import logging
import os

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.tiny import load_tokenizer, save_char_tokenizer
from hybridflow.trainer.generations import (
    carry, dump_generations, generation_rows, rollout_rows, take_carried,
    write_val_generations,
)

PROMPTS, RESPONSES = ["12+7=", "3+4="], ["19", "8"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    save_char_tokenizer(path)
    return load_tokenizer(path)


def _generated_batch(tok, prompts=PROMPTS, responses=RESPONSES, scores=None):
    """Left-padded prompts with right-padded responses, laid out as the rollout returns them."""
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    n, p_len, r_len = len(prompts), max(map(len, p_ids)), max(map(len, r_ids)) + 1
    pad = tok.pad_token_id
    b = {"prompts": torch.full((n, p_len), pad), "responses": torch.full((n, r_len), pad),
         "attention_mask": torch.zeros(n, p_len + r_len, dtype=torch.long),
         "response_mask": torch.zeros(n, r_len, dtype=torch.long),
         "token_level_scores": torch.zeros(n, r_len)}
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        b["prompts"][i, p_len - len(p):] = torch.tensor(p)
        b["responses"][i, : len(r)] = torch.tensor(r)
        b["attention_mask"][i, p_len - len(p): p_len + len(r)] = 1
        b["response_mask"][i, : len(r)] = 1
        b["token_level_scores"][i, len(r) - 1] = 0.0 if scores is None else scores[i]
    answers = [str(eval(p[:-1])) for p in prompts]
    return DataProto.from_dict(b, non_tensors={"data_source": np.array(["arithmetic"] * n, dtype=object),
                                               "ground_truth": np.array(answers, dtype=object)})


def test_rows_are_decoded_without_padding_and_carry_gts_and_reward_fields(tok):
    batch = _generated_batch(tok)
    rows = generation_rows(batch, [1.0, 0.0], tok, extras=[{"acc": True}, {"acc": False}])
    assert rows == [
        {"acc": True, "data_source": "arithmetic", "input": "12+7=", "output": "19", "gts": "19", "score": 1.0},
        {"acc": False, "data_source": "arithmetic", "input": "3+4=", "output": "8", "gts": "7", "score": 0.0}]
    assert generation_rows(batch, [1.0, 0.0], tok, limit=1)[0]["output"] == "19"
    # texts the reward function already had are used as they are, not decoded again
    assert [r["output"] for r in generation_rows(batch, [1.0, 0.0], tok, texts=["a", "b"])] == ["a", "b"]


def test_each_prompt_is_decoded_once_for_its_n_samples(tok):
    batch = _generated_batch(tok).repeat(4, interleave=True)
    calls = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(ids)
            return tok.decode(ids, **kw)

    rows = generation_rows(batch, [0.5] * 8, Counting(), texts=["x"] * 8)
    assert [r["input"] for r in rows] == ["12+7="] * 4 + ["3+4="] * 4
    assert len(calls) == 2


def test_a_step_dump_follows_the_rows_through_reordering_and_concat(tok, tmp_path):
    """What the trainer does: carry texts and reward fields from scoring, select/reorder rows
    (dynamic sampling, balancing), take them off before the workers, write the step's file."""
    first = _generated_batch(tok, scores=[0.25, 0.75])
    carry(first, ["19", "8"], {"acc": [True, False]})
    second = _generated_batch(tok, ["15+5="], ["20"], scores=[1.0])
    carry(second, ["20"], {})  # a reward function that returned no extra field for this batch
    batch = DataProto.concat([first, second]).reorder(torch.tensor([2, 0, 1]))
    carried = take_carried(batch)
    assert not [k for k in batch.non_tensor_batch if k.startswith("dump/")]
    path = dump_generations(str(tmp_path / "rollout"), 3, rollout_rows(batch, carried, tok))
    assert path == str(tmp_path / "rollout" / "3.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["input"], r["output"], r["score"], r.get("acc")) for r in rows] == [
        (3, "15+5=", "20", 1.0, None), (3, "12+7=", "19", 0.25, True), (3, "3+4=", "8", 0.75, False)]


def test_rows_from_a_reward_model_are_decoded_and_odd_values_written(tok, tmp_path):
    batch = _generated_batch(tok, scores=[0.5, -0.5])
    carry(batch, None, {"n": [np.int64(3), torch.tensor(2.0)]})  # a reward model: no text decoded
    rows = rollout_rows(batch, take_carried(batch), tok)
    assert [r["output"] for r in rows] == RESPONSES
    path = dump_generations(str(tmp_path), 0, rows)
    dump_generations(str(tmp_path), 0, rows[:1])  # a resumed run repeating the step rewrites the file
    assert [json.loads(line)["n"] for line in open(path)] == [3]


def test_a_failed_write_warns_and_training_goes_on(tok, tmp_path, caplog):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    rows = generation_rows(_generated_batch(tok), [1.0, 0.0], tok)
    with caplog.at_level(logging.WARNING):
        dump_generations(str(blocker), 1, rows)
        write_val_generations(str(blocker), 1, rows)
    assert caplog.text.count("training goes on") == 2


def test_val_generations_are_appended_per_step_and_the_first_printed(tok, tmp_path, capsys):
    rows = generation_rows(_generated_batch(tok), [1.0, 0.0], tok)
    path = write_val_generations(str(tmp_path / "run"), 0, rows)
    write_val_generations(str(tmp_path / "run"), 5, rows[:1])
    records = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["input"]) for r in records] == [(0, "12+7="), (0, "3+4="), (5, "12+7=")]
    assert "[val step 5] '12+7=' -> '19' (score 1" in capsys.readouterr().out
    # a step validated again (a resumed run, trainer.val_only on a finished run) replaces its rows
    write_val_generations(str(tmp_path / "run"), 0, rows[1:])
    records = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["input"]) for r in records] == [(5, "12+7="), (0, "3+4=")]


def test_an_unwritable_dump_folder_fails_validation_naming_the_key(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.config.validate import path_errors
    from recipes.cli import compose_config

    (tmp_path / "file").write_text("")
    cfg = load_config(compose_config("grpo", [f"trainer.rollout_data_dir={tmp_path / 'file' / 'x'}",
                                              f"trainer.validation_data_dir={tmp_path / 'val'}"]))
    errors = [e for e in path_errors(cfg) if "data_dir" in e]
    assert errors == [f"trainer.rollout_data_dir: cannot write to {tmp_path / 'file' / 'x'} (Not a directory): "
                      "use a writable folder or null"]
    assert os.path.isdir(tmp_path / "val")


def test_an_unwritable_run_folder_fails_validation_and_a_good_one_is_not_created(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.config.validate import path_errors
    from recipes.cli import compose_config

    (tmp_path / "file").write_text("")
    bad = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path / 'file' / 'run'}"]))
    assert [e for e in path_errors(bad) if "default_local_dir" in e] == [
        f"trainer.default_local_dir: cannot write to {tmp_path / 'file' / 'run'} (Not a directory): "
        "use a writable folder"]
    good = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path / 'runs' / 'a'}"]))
    assert not [e for e in path_errors(good) if "default_local_dir" in e]
    assert not os.path.exists(tmp_path / "runs")
