"""TensorBoard scalars under `<output_dir>/tensorboard` (one tag per metric key).

Each process writes its own event file in that folder, and TensorBoard shows the folder as one
run. A resumed run must therefore hide what its killed predecessor logged after the checkpoint,
or steps 11-13 show twice: `drop_after(step)` opens the writer with `purge_step=step + 1`, whose
SessionLog.START event makes TensorBoard drop every earlier-read event at or past that step.
`drop_after(-1)` (a fresh run in a used folder) purges from step 0, so earlier runs' curves are
hidden, not deleted (the files stay; jsonl drops its records for the same reason). Without a
`drop_after` call (`trainer.val_only`, direct use) the new file simply adds to the folder.

Two details the purge depends on:
- TensorBoard's reader takes a folder's first START event as the session's start, not a restart,
  and purges nothing for it; files written before this logger wrote START events have none, so
  a second START is written right after the first (a repeated purge at one step is a no-op).
- It reads a folder's event files in name order (`events.out.tfevents.<unix seconds>....`) and a
  purge only hides events read before it: a file opened in the same second as an existing one
  could sort first, so the writer waits for the next second then (tests; never a real resume).

The writer is therefore created lazily, at the first `drop_after` or `log` (or at `finish`, so an
empty run still shows its config).
"""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Any


class TensorboardLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "trainer.logger 'tensorboard' needs the tensorboard package: "
                "pip install tensorboard (a core dependency of hybridflow; reinstall it)") from e
        self._SummaryWriter = SummaryWriter
        self.log_dir = os.path.join(output_dir, "tensorboard")
        # The config as a text summary so a run's settings are visible next to its curves.
        self._config_text = (f"{project_name}/{experiment_name}\n\n```\n"
                             f"{json.dumps(config, indent=2, default=str)}\n```")
        self._writer = None

    def _open(self, purge_step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        if self._writer is not None:
            self._writer.close()
        _wait_to_sort_after(self.log_dir)
        self._writer = self._SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
        if purge_step is not None:  # see the module docstring: the reader ignores a first START
            self._writer.file_writer.add_event(
                Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        # At the purge step on a resume: the config from where it applies (it may have changed).
        self._writer.add_text("config", self._config_text, global_step=purge_step or 0)
        self._writer.flush()

    def drop_after(self, step: int) -> None:
        """Hide the folder's events at steps > ``step`` (-1: all) from TensorBoard."""
        self._open(purge_step=max(step + 1, 0))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            self._open(purge_step=None)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        # SummaryWriter flushes every 120 s by default; a step is minutes of RL work, so
        # flushing per step costs nothing and a crash loses no curve points.
        self._writer.flush()

    def finish(self) -> None:
        if self._writer is None:
            self._open(purge_step=None)
        self._writer.close()


def _wait_to_sort_after(log_dir: str) -> None:
    """Sleep into the next second if an event file in ``log_dir`` is from this second (or up to
    two seconds ahead: a clock further off cannot be waited out), so a new file sorts last."""
    stamps = [int(name.split(".")[3]) for name in
              (os.path.basename(p) for p in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))
              if name.split(".")[3].isdigit()]
    wait = max(stamps, default=0) + 1 - time.time()
    if 0 < wait <= 3:
        time.sleep(wait)
