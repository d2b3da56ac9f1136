"""Generated sequences as text rows in JSON-lines files: one module for three outputs.

- ``trainer.rollout_data_dir``: every sequence of a training step, ``<dir>/<step>.jsonl``.
- ``trainer.validation_data_dir``: every sample of a validation, ``<dir>/<step>.jsonl``.
- ``trainer.log_val_generations=N``: the first N samples of each validation appended to
  ``<default_local_dir>/val_generations.jsonl`` and the first printed (verl logs them as a W&B
  table; a file is readable by anyone). They are the first N of the validation set, the same
  prompts every time, so their answers can be compared across steps.

A row is verl's ``_dump_generations`` record: ``input`` (prompt text), ``output`` (response text),
``gts`` (ground truth), ``score``, ``step``, plus ``data_source`` and the extra fields the reward
function returned for that sample (e.g. ``acc``). The files are a side output: a write that fails
logs a warning and training goes on; the folders are checked writable before Ray starts
(``hybridflow/host_checks.py``, called from hybridflow/config/validate.py).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from hybridflow.trajectory import response_token_mask

logger = logging.getLogger(__name__)

VAL_GENERATIONS_FILE = "val_generations.jsonl"
# Non-tensor columns the trainer hangs on a step's rows between scoring and the dump, so that the
# texts decoded for the reward function follow the rows through dynamic sampling and balancing
# instead of being decoded a second time.
RESPONSE_TEXT = "dump/response_text"
REWARD_EXTRA = "dump/reward_extra"


def generation_rows(batch, scores: Sequence[float], tokenizer, texts: Sequence[str] | None = None,
                    extras: Sequence[dict] | None = None, limit: int | None = None) -> list[dict]:
    """The first ``limit`` (default all) rows of a generated batch as text. ``texts``: the
    responses already decoded (else decoded here); ``extras``: per-row reward fields. Special
    tokens and padding are dropped."""
    b, nt = batch.batch, batch.non_tensor_batch
    count = len(batch) if limit is None else min(limit, len(batch))
    prompt_len = b["prompts"].shape[1]
    prompts, prompt_mask = b["prompts"][:count].tolist(), b["attention_mask"][:count, :prompt_len].tolist()
    sources, gts = nt.get("data_source"), nt.get("ground_truth")
    response_mask = response_token_mask(b)  # a multi-turn row's tool responses too
    decoded: dict[tuple, str] = {}  # the rollout.n samples of a prompt share it: decode it once
    rows = []
    for i in range(count):
        ids = tuple(t for t, keep in zip(prompts[i], prompt_mask[i]) if keep)
        if ids not in decoded:
            decoded[ids] = tokenizer.decode(list(ids), skip_special_tokens=True)
        if texts is None:
            output = tokenizer.decode(b["responses"][i][response_mask[i].bool()].tolist(),
                                      skip_special_tokens=True)
        else:
            output = texts[i]
        row = dict(extras[i]) if extras is not None else {}  # verl's fields below win over a same-named extra
        row.update(data_source=None if sources is None else str(sources[i]), input=decoded[ids], output=output,
                   gts=None if gts is None else gts[i], score=float(scores[i]))
        rows.append(row)
    return rows


def extras_per_row(columns: dict[str, Sequence[Any]], count: int) -> list[dict]:
    """The reward manager's extra fields (one list per key) as one dict per row."""
    return [{key: values[i] for key, values in columns.items()} for i in range(count)]


# ---------------------------------------------------------------------- carrying texts on a batch
def _objects(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element by element: equal-length lists must not become a 2-D array
        out[i] = value
    return out


def carry(batch, texts: Sequence[str] | None, extra_columns: dict[str, Sequence[Any]], order=None) -> None:
    """Hang the scored texts (None: the rows came from a reward model, no text was decoded) and
    the reward fields on the batch's rows (``order``: the rows were scored before the batch was
    reordered by it). One dict column for the fields, so batches whose functions returned other
    keys still concatenate."""
    nt, rows = batch.non_tensor_batch, slice(None) if order is None else np.asarray(order)
    nt[RESPONSE_TEXT] = _objects([None] * len(batch) if texts is None else texts)[rows]
    nt[REWARD_EXTRA] = _objects(extras_per_row(extra_columns, len(batch)))[rows]


def take_carried(batch) -> dict | None:
    """Remove what ``carry`` hung on the batch (the workers need none of it) and return it; None
    when nothing hangs there (no dump asked for, or the scores are still being computed)."""
    nt = batch.non_tensor_batch
    if RESPONSE_TEXT not in nt:
        return None
    return {"texts": nt.pop(RESPONSE_TEXT), "extras": nt.pop(REWARD_EXTRA)}


def rollout_rows(batch, carried: dict, tokenizer) -> list[dict]:
    """A training step's rows; the score is the one the step trained on (verl's: the sum of the
    token-level scores), so the file agrees with ``critic/score/*``."""
    texts = carried["texts"]
    return generation_rows(batch, batch.batch["token_level_scores"].sum(-1).tolist(), tokenizer,
                           texts=None if len(texts) == 0 or texts[0] is None else texts, extras=carried["extras"])


# ---------------------------------------------------------------------- files
def _jsonable(value: Any) -> Any:
    """numpy / torch values a reward function may return, as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def write_jsonl(path: str, step: int, rows: list[dict], append: bool = False, head: list[str] = ()) -> bool:
    """Write ``rows`` (each with ``step``) to ``path``, after the raw lines ``head``; on failure log
    a warning and return False: losing a text dump must never lose the run."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        lines = [json.dumps({"step": step, **row}, ensure_ascii=False, default=_jsonable) + "\n" for row in rows]
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            f.writelines(list(head) + lines)
    except (OSError, TypeError, ValueError) as err:
        logger.warning("could not write %d generations of step %d to %s (%s); training goes on",
                       len(rows), step, path, err)
        return False
    return True


def dump_generations(folder: str, step: int, rows: list[dict]) -> str:
    """``<folder>/<step>.jsonl`` (rewritten when a resumed run repeats the step); returns its path."""
    path = os.path.join(folder, f"{step}.jsonl")
    write_jsonl(path, step, rows)
    return path


def _lines_of_other_steps(path: str, step: int) -> list[str]:
    """The lines of ``path`` that belong to steps other than ``step`` (a line that does not parse
    is kept: its step is unknown)."""
    kept = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line).get("step") == step:
                        continue
                except (ValueError, AttributeError):
                    pass
                kept.append(line if line.endswith("\n") else line + "\n")
    except OSError:
        pass
    return kept


def write_val_generations(output_dir: str, step: int, rows: list[dict]) -> str:
    """Add ``rows`` for ``step`` to val_generations.jsonl; print the first; return the file's path.

    A step validated again (a resumed run repeating its killed predecessor's steps,
    ``trainer.val_only`` on a finished run) replaces that step's earlier rows instead of adding a
    second copy."""
    path = os.path.join(output_dir, VAL_GENERATIONS_FILE)
    if write_jsonl(path, step, rows, head=_lines_of_other_steps(path, step)) and rows:
        first = rows[0]
        print(f"[val step {step}] {first['input']!r} -> {first['output']!r} (score {first['score']:g}; "
              f"{len(rows)} samples in {path})", flush=True)
    return path
