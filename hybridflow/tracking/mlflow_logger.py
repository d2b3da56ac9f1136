"""MLflow run in a local SQLite store under `<output_dir>/mlruns` (no tracking server), or where
MLFLOW_TRACKING_URI points when it is set (a server, or the user's own store).

The store is `<output_dir>/mlruns/mlflow.db` with artifacts in `<output_dir>/mlruns/artifacts`.
Not the plain `./mlruns` file store: MLflow 3.x put that in maintenance mode and refuses to open
it unless MLFLOW_ALLOW_FILE_STORE=true is set process-wide; SQLite is its local replacement.

Uses `MlflowClient` with an explicit tracking URI instead of the fluent `mlflow.start_run`
API, so nothing global changes (no active run, MLFLOW_TRACKING_URI only read) and two trackers in
one process do not interfere. Browse with
`mlflow ui --backend-store-uri sqlite:///<output_dir>/mlruns/mlflow.db`.
The experiment is `project_name`, the run name is `experiment_name`, params are the flattened
config.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from hybridflow.tracking.flatten import flatten_config

# MLflow rejects metric/param names outside this set; "val/pass@1" becomes "val/pass_1".
_INVALID_NAME_CHARS = re.compile(r"[^\w\-. :/]")
_PARAMS_PER_BATCH = 100      # mlflow's MAX_PARAMS_TAGS_PER_BATCH
_METRICS_PER_BATCH = 1000    # mlflow's MAX_METRICS_PER_BATCH


def mlflow_name(key: str) -> str:
    return _INVALID_NAME_CHARS.sub("_", key)


class MlflowLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(
                "trainer.logger 'mlflow' needs the mlflow package: "
                "pip install 'hybridflow[loggers]' (or pip install mlflow)") from e
        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
        except ImportError:  # older mlflow: the documented limit of those versions
            MAX_PARAM_VAL_LENGTH = 500
        self._Metric, self._max_param_len = Metric, MAX_PARAM_VAL_LENGTH
        # MLFLOW_TRACKING_URI (a tracking server, or a store of the user's) wins, as in verl
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None  # the store's own default
        if not self.tracking_uri:
            store_dir = os.path.join(os.path.abspath(output_dir), "mlruns")
            os.makedirs(store_dir, exist_ok=True)
            self.tracking_uri = "sqlite:///" + os.path.join(store_dir, "mlflow.db")
            artifacts = Path(store_dir, "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(project_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(project_name, artifact_location=artifacts))
        self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
        params = [Param(mlflow_name(k), self._param_value(v))
                  for k, v in flatten_config(config).items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _PARAMS_PER_BATCH])

    def _param_value(self, value: Any) -> str:
        text = str(value)
        # Over-long values (a long list of data files) are cut rather than failing the run.
        return text if len(text) <= self._max_param_len else text[:self._max_param_len - 3] + "..."

    def log(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        batch = [self._Metric(mlflow_name(k), float(v), now_ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + _METRICS_PER_BATCH])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
