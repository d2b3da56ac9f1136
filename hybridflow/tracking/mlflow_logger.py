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

One output folder is one MLflow run, as it is one metrics.jsonl: the run's id is kept in
`<output_dir>/mlflow_run.json` (next to the output even when MLFLOW_TRACKING_URI points
elsewhere), and a process continues that run unless `drop_after(-1)` says it starts over (a fresh
run in a used folder gets a new MLflow run). So a run resumed from a checkpoint (`drop_after(step)`)
logs into the run of the attempt it resumes, and a `trainer.val_only` evaluation adds its scores
to it. A recorded run that is gone from the store, deleted, or in another experiment is not
continued: a new one is made. The run is created at the first `drop_after` or `log`, never
earlier, so deciding to continue leaves no empty run behind.

MLflow cannot delete single metric points: steps past the checkpoint that a killed attempt logged
stay, and the resumed run appends its own values at the same steps (at a step logged twice the
later timestamp is the resumed value; the `resumed_after_step` tag names the last resume's
checkpoint). Params cannot change either (MLflow rejects a new value for a logged param): on
continuing, params not yet logged are added, and one whose value changed (a resume may raise
`trainer.total_training_steps`) gets a tag `changed_param.<name>` with the value the latest process
ran with.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from hybridflow.checkpoint_files import write_atomically
from hybridflow.tracking.flatten import flatten_config

# MLflow rejects metric/param names outside this set; "val/pass@1" becomes "val/pass_1".
_INVALID_NAME_CHARS = re.compile(r"[^\w\-. :/]")
_PARAMS_PER_BATCH = 100      # mlflow's MAX_PARAMS_TAGS_PER_BATCH
_METRICS_PER_BATCH = 1000    # mlflow's MAX_METRICS_PER_BATCH
RUN_FILE = "mlflow_run.json"  # in the output dir: {"run_id": the folder's run}
CHANGED = "changed_param."    # tag prefix: a param's value in the latest process, where it differs


def mlflow_name(key: str) -> str:
    return _INVALID_NAME_CHARS.sub("_", key)


class MlflowLogger:
    def __init__(self, output_dir: str, project_name: str, experiment_name: str,
                 config: dict[str, Any]):
        try:
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(
                "trainer.logger 'mlflow' needs the mlflow package: "
                "pip install 'hybridflow[loggers]' (or pip install mlflow)") from e
        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
        except ImportError:  # older mlflow: the documented limit of those versions
            MAX_PARAM_VAL_LENGTH = 500
        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self._MlflowException, self._max_param_len = MlflowException, MAX_PARAM_VAL_LENGTH
        # MLFLOW_TRACKING_URI (a tracking server, or a store of the user's) wins, as in verl
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None  # the store's own default
        if not self.tracking_uri:
            store_dir = os.path.join(os.path.abspath(output_dir), "mlruns")
            os.makedirs(store_dir, exist_ok=True)
            self.tracking_uri = "sqlite:///" + os.path.join(store_dir, "mlflow.db")
            artifacts = Path(store_dir, "artifacts").as_uri()
        # the store is opened here, so a wrong URI fails before training starts
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(project_name)
        self.experiment_id = (experiment.experiment_id if experiment is not None
                              else self.client.create_experiment(project_name, artifact_location=artifacts))
        self.run_name = experiment_name
        self.params = {mlflow_name(k): self._param_value(v) for k, v in flatten_config(config).items()}
        os.makedirs(output_dir, exist_ok=True)
        self.run_file = os.path.join(output_dir, RUN_FILE)
        self.run_id: str | None = None  # created or continued at the first drop_after / log

    def _param_value(self, value: Any) -> str:
        text = str(value)
        # Over-long values (a long list of data files) are cut rather than failing the run.
        return text if len(text) <= self._max_param_len else text[:self._max_param_len - 3] + "..."

    def _recorded_run(self):
        """The run this folder logged into, if the store still holds it live in this experiment."""
        try:
            with open(self.run_file, encoding="utf-8") as f:
                run_id = json.load(f)["run_id"]
            run = self.client.get_run(run_id)
        except (OSError, ValueError, KeyError, TypeError, self._MlflowException):
            return None  # no record, a torn one, or a run this store does not have
        if run.info.lifecycle_stage != "active" or run.info.experiment_id != self.experiment_id:
            return None
        return run

    def _start(self, continue_recorded: bool) -> None:
        run = self._recorded_run() if continue_recorded else None
        if run is None:
            self.run_id = self.client.create_run(self.experiment_id, run_name=self.run_name).info.run_id
            params, tags = self.params, {}
            # the id only (a URI can hold credentials), atomically: a crash never leaves half a record
            write_atomically(self.run_file, json.dumps({"run_id": self.run_id}))
        else:
            self.run_id, logged = run.info.run_id, run.data.params
            self.client.update_run(self.run_id, status="RUNNING")
            params = {k: v for k, v in self.params.items() if k not in logged}
            tags = {CHANGED + k: v for k, v in self.params.items() if k in logged and logged[k] != v}
            for stale in set(run.data.tags) - set(tags):  # changed back since: the param holds
                if stale.startswith(CHANGED) and stale[len(CHANGED):] in self.params:
                    self.client.delete_tag(self.run_id, stale)
        self._log_batches(params=[self._Param(k, v) for k, v in params.items()],
                          tags=[self._RunTag(k, v) for k, v in tags.items()])

    def _log_batches(self, params=(), tags=(), metrics=()) -> None:
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _PARAMS_PER_BATCH])
        for i in range(0, len(tags), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=tags[i:i + _PARAMS_PER_BATCH])
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _METRICS_PER_BATCH])

    def drop_after(self, step: int) -> None:
        """Continue this folder's run (``step`` >= 0) or start a new one (-1). Called once logging
        has begun it changes nothing: MLflow cannot take logged points back."""
        if self.run_id is not None:
            return
        self._start(continue_recorded=step >= 0)
        if step >= 0:
            self.client.set_tag(self.run_id, "resumed_after_step", str(step))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run_id is None:
            self._start(continue_recorded=True)
        now_ms = int(time.time() * 1000)
        self._log_batches(metrics=[self._Metric(mlflow_name(k), float(v), now_ms, step)
                                   for k, v in metrics.items()])

    def finish(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
