"""Print a few headline metrics per step as one row of an aligned table.

Only the columns below are shown (the full set goes to metrics.jsonl); a column whose metric is
absent this step prints "-" (validation scores exist only on test steps). The header is
repeated every `header_every` rows so it stays on screen in a long log.
"""
from __future__ import annotations

import math
import sys
from typing import Any, TextIO

# (metric key, column title); "step" is the step argument, not a metric.
COLUMNS: list[tuple[str, str]] = [
    ("step", "step"),
    ("critic/score/mean", "score"),
    ("val/score/mean", "val_score"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/grad_norm", "grad_norm"),
    ("timing_s/step", "step_s"),
]
# The SFT trainer logs other metrics; the table shows whichever set the first step fills best.
SFT_COLUMNS: list[tuple[str, str]] = [
    ("step", "step"),
    ("train/nll", "nll"),
    ("val/nll", "val_nll"),
    ("train/lr", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("timing_s/step", "step_s"),
]
WIDTH = 11


def _cell(value: float | None) -> str:
    if value is None:
        return "-".rjust(WIDTH)
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()
                                  and abs(value) < 1e9):
        return str(int(value)).rjust(WIDTH)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).rjust(WIDTH)
    return f"{value:.4g}".rjust(WIDTH)


class ConsoleLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any], stream: TextIO | None = None, header_every: int = 20):
        self._stream = stream
        self._header_every = header_every
        self._rows = 0
        self._columns: list[tuple[str, str]] | None = None

    def _out(self) -> TextIO:
        # Resolved per call, not at construction: pytest's capsys and Ray's log redirection
        # replace sys.stdout after the tracker exists.
        return self._stream if self._stream is not None else sys.stdout

    def log(self, metrics: dict[str, float], step: int) -> None:
        out = self._out()
        if self._columns is None:
            self._columns = max((COLUMNS, SFT_COLUMNS), key=lambda cols: sum(k in metrics for k, _ in cols))
        if self._rows % self._header_every == 0:
            print(" ".join(title.rjust(WIDTH) for _, title in self._columns), file=out)
        values = [step if key == "step" else metrics.get(key) for key, _ in self._columns]
        print(" ".join(_cell(v) for v in values), file=out, flush=True)
        self._rows += 1

    def finish(self) -> None:
        self._out().flush()
