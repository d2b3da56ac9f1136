"""``trainer.log_val_generations``: a few validation samples, as text, at every validation.

verl logs them as a W&B table; here they go where any user can read them: one JSON object per
sample appended to ``<default_local_dir>/val_generations.jsonl`` (``step``, ``data_source``,
``input``, ``output``, ``score``), and the first one printed. The samples are the first N of the
validation set, the same prompts every time, so their answers can be compared across steps.
"""
from __future__ import annotations

import json
import os

VAL_GENERATIONS_FILE = "val_generations.jsonl"


def sample_rows(batch, scores, tokenizer, limit: int) -> list[dict]:
    """Up to ``limit`` rows of a generated validation batch, decoded (special tokens dropped)."""
    b, rows = batch.batch, []
    for i in range(min(limit, len(batch))):
        prompt = b["prompts"][i][b["attention_mask"][i, : b["prompts"].shape[1]].bool()]
        response = b["responses"][i][b["response_mask"][i].bool()]
        rows.append({"data_source": str(batch.non_tensor_batch["data_source"][i]),
                     "input": tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
                     "output": tokenizer.decode(response.tolist(), skip_special_tokens=True),
                     "score": float(scores[i])})
    return rows


def write_val_generations(output_dir: str, step: int, rows: list[dict]) -> str:
    """Append ``rows`` for ``step``; print the first; return the file's path."""
    path = os.path.join(output_dir, VAL_GENERATIONS_FILE)
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
    if rows:
        first = rows[0]
        print(f"[val step {step}] {first['input']!r} -> {first['output']!r} (score {first['score']:g}; "
              f"{len(rows)} samples in {path})", flush=True)
    return path
