"""Weights & Biases run, offline by default, written under `<output_dir>/wandb`.

Offline needs no account or network; upload later with `wandb sync <output_dir>/wandb/offline-run-*`.
Set WANDB_MODE=online (after `wandb login`) to stream instead. The nested config is passed as
is (W&B shows nested keys itself).
"""
from __future__ import annotations

import os
from typing import Any


class WandbLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.logger 'wandb' needs the wandb package: "
                "pip install 'hybridflow[loggers]' (or pip install wandb)") from e
        os.makedirs(output_dir, exist_ok=True)
        self.run = wandb.init(project=project_name, name=experiment_name, config=config,
                              dir=os.path.abspath(output_dir),
                              mode=os.environ.get("WANDB_MODE", "offline"))
        self.run_dir = os.path.dirname(self.run.dir)  # .../wandb/offline-run-<time>-<id>

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        import wandb
        self.run.finish()
        # finish() can return before the wandb service has flushed the run's .wandb file; on a
        # loaded machine a reader (`wandb sync` right after training, a test) then finds it
        # empty. teardown() stops the service, which closes the file (it costs milliseconds).
        wandb.teardown()
