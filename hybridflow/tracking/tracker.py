"""One object the trainer logs to; it fans each step's metrics out to the chosen backends.

    tracker = Tracker(cfg.trainer.logger, cfg.trainer.project_name,
                      cfg.trainer.experiment_name, cfg.trainer.default_local_dir, config_dict)
    tracker.log({"critic/score/mean": 0.4, ...}, step=3)
    tracker.finish()

Every backend has the same three-call shape: `__init__(output_dir, project_name,
experiment_name, config)`, `log(metrics, step)`, `finish()`, and optionally `drop_after(step)`
(where a resumed or fresh run starts, called before its first `log`). The names accepted in
`trainer.logger` are the keys of `BACKENDS`; adding a backend means adding one file and one
entry there.
"""
from __future__ import annotations

import numbers
from typing import Any, Iterable

from hybridflow.tracking.console_logger import ConsoleLogger
from hybridflow.tracking.jsonl_logger import JsonlLogger
from hybridflow.tracking.mlflow_logger import MlflowLogger
from hybridflow.tracking.tensorboard_logger import TensorboardLogger
from hybridflow.tracking.wandb_logger import WandbLogger

BACKENDS: dict[str, type] = {
    "console": ConsoleLogger,
    "jsonl": JsonlLogger,
    "tensorboard": TensorboardLogger,
    "mlflow": MlflowLogger,
    "wandb": WandbLogger,
}

# the package each optional backend imports, and how to get it
BACKEND_PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "pip install tensorboard"),
                    "mlflow": ("mlflow", "pip install 'hybridflow[loggers]' (or pip install mlflow)"),
                    "wandb": ("wandb", "pip install 'hybridflow[loggers]' (or pip install wandb)")}


def backend_import_errors(names: Iterable[str]) -> list[str]:
    """One line per requested backend whose package does not import here (run before Ray starts,
    so a missing logger costs a second, not a model load)."""
    import importlib

    errors = []
    for name in dict.fromkeys(names):
        if name not in BACKEND_PACKAGES:
            continue
        module, fix = BACKEND_PACKAGES[name]
        try:
            importlib.import_module(module)
        except Exception as err:  # a broken install is as unusable as a missing one
            reason = str(err).splitlines()[0] if str(err) else ""
            errors.append(f"trainer.logger '{name}' needs the {module.split('.')[-1]} package "
                          f"({type(err).__name__}: {reason}): {fix}")
    return errors


def with_jsonl(loggers: str | Iterable[str]) -> list[str]:
    """A recipe's loggers: the user's ``trainer.logger`` plus ``jsonl``.

    Recipes always write ``metrics.jsonl``: the reward-curve plot at the end reads it, and it is
    the one record of a run that needs no extra package. verl's configs list ``[console, wandb]``
    and the like, so a user's list that leaves it out must not lose it."""
    names = [loggers] if isinstance(loggers, str) else list(loggers)
    return names if "jsonl" in names else names + ["jsonl"]


def _as_float(key: str, value: Any) -> float:
    # numbers.Real covers int, float, numpy scalars; 0-d tensors expose .item().
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__} "
                        f"({value!r}); log numbers only (tensor.item(), float(x))")
    return float(value)


class Tracker:
    def __init__(self, loggers: str | Iterable[str], project_name: str, experiment_name: str,
                 output_dir: str, config: dict[str, Any] | None = None):
        names = [loggers] if isinstance(loggers, str) else list(loggers)
        unknown = [n for n in names if n not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; "
                             f"valid names are {sorted(BACKENDS)}")
        if len(set(names)) != len(names):
            raise ValueError(f"trainer.logger lists a logger twice: {names}")
        if config is not None and not isinstance(config, dict):
            from omegaconf import DictConfig, OmegaConf
            if not isinstance(config, DictConfig):
                raise TypeError(f"Tracker config must be a dict, got {type(config).__name__}")
            # Backends read plain containers; interpolations resolved as the run sees them.
            config = OmegaConf.to_container(config, resolve=True)
        self.output_dir = output_dir
        self.backends: dict[str, Any] = {}
        try:
            for name in names:
                self.backends[name] = BACKENDS[name](output_dir, project_name, experiment_name,
                                                     dict(config or {}))
        except BaseException:
            self.finish()  # close the ones already opened (files, wandb service)
            raise

    def drop_after(self, step: int) -> None:
        """Called once a run knows where it starts: after ``step`` (-1: a fresh start, nothing
        kept) the earlier attempts' records do not count. jsonl drops them, TensorBoard hides them,
        MLflow continues the folder's run (or starts a new one for -1); see each backend."""
        for backend in self.backends.values():
            if hasattr(backend, "drop_after"):
                backend.drop_after(step)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log one step. Values are converted to float here, once, for every backend."""
        clean = {key: _as_float(key, value) for key, value in metrics.items()}
        for backend in self.backends.values():
            backend.log(clean, int(step))

    def finish(self) -> None:
        """Flush and close every backend; safe to call twice."""
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.finish()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
