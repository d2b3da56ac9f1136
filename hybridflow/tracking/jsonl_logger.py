"""Append one JSON object per step to `<output_dir>/metrics.jsonl`.

The file is opened in append mode so a resumed run keeps the history of the run it resumes. The
trainer then calls `drop_after(step)`: a resumed run drops the records its killed predecessor
logged after the checkpoint (it logs those steps again), a fresh run in a used folder drops
everything (else its curve would mix two runs). Readers still keep the last record of a step
(`hybridflow.tracking.plot.read_metrics`). Every line is flushed so `tail -f` and a crash both
see complete steps.

A second log of the step the file ends with (``trainer.val_only`` on a finished run logs the
final step's validation again) merges into that record instead of adding one: a reader keeping a
step's last record would otherwise lose the step's training metrics.
"""
from __future__ import annotations

import json
import os
from typing import Any

from hybridflow.checkpoint_files import write_atomically

METRICS_FILE = "metrics.jsonl"


class JsonlLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._read_last_record()
        self._file = open(self.path, "a", encoding="utf-8")

    def _read_last_record(self) -> None:
        """The file's last record and the byte offset where it starts (None: no record).

        Every record is written as one whole line, so bytes after the last newline are a write
        that a killed process left torn: they are cut off, and the next record starts a line."""
        self._last, self._last_offset, offset = None, 0, 0
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                if line.strip():
                    try:
                        self._last, self._last_offset = json.loads(line), offset
                    except ValueError:  # never merge into a line that is not a record
                        self._last = None
                offset += len(line)
        if os.path.getsize(self.path) > offset:
            os.truncate(self.path, offset)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # "step" first so `head metrics.jsonl` reads naturally; NaN/inf are written as
        # Python's json writes them (NaN, Infinity), which json.loads and pandas read back.
        record = {"step": step, **metrics}
        if isinstance(self._last, dict) and self._last.get("step") == step:
            record = {**self._last, **metrics}
            self._file.truncate(self._last_offset)
        self._last_offset = self._file.seek(0, os.SEEK_END)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last = record

    def drop_after(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (-1: none)."""
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and _step_of(line) <= step]
        # atomically: a kill during an in-place rewrite lost the records of the steps kept
        write_atomically(self.path, "".join(kept))
        self._read_last_record()
        self._file = open(self.path, "a", encoding="utf-8")

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


def _step_of(line: str) -> float:
    """A record's step; a line that is not a record counts as past every step (dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")
