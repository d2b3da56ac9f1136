"""trainer.log_val_generations: decoded samples of a validation batch, appended per step."""
import json

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.tiny import load_tokenizer, save_char_tokenizer
from hybridflow.trainer.val_generations import sample_rows, write_val_generations


def _generated_batch(tok):
    """Two left-padded prompts with right-padded responses, laid out as the rollout returns them."""
    prompts = [tok("12+7=", add_special_tokens=False)["input_ids"], tok("3+4=", add_special_tokens=False)["input_ids"]]
    responses = [tok("19", add_special_tokens=False)["input_ids"], tok("8", add_special_tokens=False)["input_ids"]]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses)) + 1
    pad = tok.pad_token_id
    b = {"prompts": torch.full((2, p_len), pad), "responses": torch.full((2, r_len), pad),
         "attention_mask": torch.zeros(2, p_len + r_len, dtype=torch.long),
         "response_mask": torch.zeros(2, r_len, dtype=torch.long)}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        b["prompts"][i, p_len - len(p):] = torch.tensor(p)
        b["responses"][i, : len(r)] = torch.tensor(r)
        b["attention_mask"][i, p_len - len(p): p_len + len(r)] = 1
        b["response_mask"][i, : len(r)] = 1
    return DataProto.from_dict(b, non_tensors={"data_source": np.array(["arithmetic", "arithmetic"], dtype=object)})


def test_samples_are_decoded_without_padding_and_appended_per_step(tmp_path, capsys):
    save_char_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    batch = _generated_batch(tok)
    rows = sample_rows(batch, [1.0, 0.0], tok, limit=5)
    assert rows == [{"data_source": "arithmetic", "input": "12+7=", "output": "19", "score": 1.0},
                    {"data_source": "arithmetic", "input": "3+4=", "output": "8", "score": 0.0}]
    assert sample_rows(batch, [1.0, 0.0], tok, limit=1) == rows[:1]
    path = write_val_generations(str(tmp_path / "run"), 0, rows)
    write_val_generations(str(tmp_path / "run"), 5, rows[:1])
    records = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["input"]) for r in records] == [(0, "12+7="), (0, "3+4="), (5, "12+7=")]
    assert "[val step 5] '12+7=' -> '19' (score 1" in capsys.readouterr().out
