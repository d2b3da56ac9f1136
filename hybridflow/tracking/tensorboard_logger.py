"""TensorBoard scalars under `<output_dir>/tensorboard` (one tag per metric key)."""
from __future__ import annotations

import json
import os
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
        self.log_dir = os.path.join(output_dir, "tensorboard")
        self._writer = SummaryWriter(log_dir=self.log_dir)
        # The config as a text summary so a run's settings are visible next to its curves.
        self._writer.add_text(
            "config", f"{project_name}/{experiment_name}\n\n```\n"
            f"{json.dumps(config, indent=2, default=str)}\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        # SummaryWriter flushes every 120 s by default; a step is minutes of RL work, so
        # flushing per step costs nothing and a crash loses no curve points.
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()
