"""Append one JSON object per step to `<output_dir>/metrics.jsonl`.

The file is opened in append mode so a resumed run keeps the history of the run it resumes. The
trainer then calls `drop_after(step)`: a resumed run drops the records its killed predecessor
logged after the checkpoint (it logs those steps again), a fresh run in a used folder drops
everything (else its curve would mix two runs). Readers still keep the last record of a step
(`hybridflow.tracking.plot.read_metrics`). Every line is flushed so `tail -f` and a crash both
see complete steps.
"""
from __future__ import annotations

import json
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"


class JsonlLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # "step" first so `head metrics.jsonl` reads naturally; NaN/inf are written as
        # Python's json writes them (NaN, Infinity), which json.loads and pandas read back.
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def drop_after(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (-1: none)."""
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        self._file = open(self.path, "a", encoding="utf-8")

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()
