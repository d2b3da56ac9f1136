"""Weights & Biases run, offline by default, written under `<output_dir>/wandb`.

Offline needs no account or network; upload later with `wandb sync <output_dir>/wandb/offline-run-*`.
Set WANDB_MODE=online (after `wandb login`) to stream instead. The nested config is passed as
is (W&B shows nested keys itself).

A resumed run (the trainer's `drop_after(step)`) is not continued as one W&B run, unlike MLflow:
offline, wandb (0.31 checked) ignores `wandb.init(id=..., resume="allow")` (`run.resumed` stays
False), and each process writes its own `offline-run-<time>-<id>` folder starting from nothing.
Reusing the id would let `wandb sync` upload those folders into one run in start order, but W&B
keeps a run's steps increasing and ignores values logged at or below the run's last step: the
resumed values of the steps that the killed attempt had already logged would be dropped and the
killed attempt's kept, a curve that looks continuous and is wrong. Cutting the history back
(`resume_from`, "rewind") is done by the W&B server, so it cannot happen offline. Hence each
process keeps its own run; the resumed one starts at the checkpoint's next step.
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
