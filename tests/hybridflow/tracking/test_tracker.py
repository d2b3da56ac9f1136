"""Each tracking backend writes what a user reads back: the file, the event log, the run."""
import glob
import json
import struct
import sys

import numpy as np
import pytest
import torch

from hybridflow.tracking import BACKENDS, Tracker, flatten_config, read_metrics, with_jsonl

CONFIG = {"trainer": {"total_epochs": 2, "logger": ["jsonl"]},
          "algorithm": {"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.001}},
          "data": {"train_files": ["a.parquet", "b.parquet"]}}
STEPS = {1: {"critic/score/mean": 0.25, "response_length/mean": 31.5, "actor/pg_loss": -0.125},
         2: {"critic/score/mean": 0.5, "response_length/mean": 28.0, "actor/pg_loss": 0.0625,
             "val/score/mean": 0.75, "val/pass@1": 0.5}}


def _log_steps(tracker):
    for step, metrics in STEPS.items():
        tracker.log(metrics, step=step)
    tracker.finish()


def test_jsonl_one_record_per_step_and_resume_appends(tmp_path):
    _log_steps(Tracker(["jsonl"], "proj", "exp", str(tmp_path), CONFIG))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": s, **m} for s, m in STEPS.items()]

    # A later run in the same dir appends; the step the file ends with, logged again, merges
    # into its record (new values win, the others stay).
    with Tracker("jsonl", "proj", "exp", str(tmp_path), CONFIG) as tracker:
        tracker.log({"critic/score/mean": 0.875}, step=2)
        tracker.log({"critic/score/mean": 1.0}, step=3)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 0.25), (2, 0.875),
                                                                       (3, 1.0)]
    assert records[1]["val/score/mean"] == 0.75 and records[1]["actor/pg_loss"] == 0.0625


def test_validating_a_finished_run_again_keeps_its_last_training_record(tmp_path):
    """trainer.val_only on a finished run logs the final step's validation once more: the step's
    record keeps its training metrics (a reader keeps one record per step) and the new val ones."""
    _log_steps(Tracker(["jsonl"], "proj", "exp", str(tmp_path), CONFIG))
    with Tracker("jsonl", "proj", "exp", str(tmp_path), CONFIG) as tracker:
        tracker.log({"val/score/mean": 0.8125}, step=2)
        tracker.log({"val/score/mean": 0.875}, step=2)  # and again, in the same process
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, **STEPS[1]},
                                                    {"step": 2, **STEPS[2], "val/score/mean": 0.875}]
    # a run killed mid-write leaves a torn last line: the next run cuts it off, and readers and
    # the resume's drop_after see whole records only
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "critic/sc')
    with Tracker("jsonl", "proj", "exp", str(tmp_path), CONFIG) as tracker:
        tracker.drop_after(2)
        tracker.log({"critic/score/mean": 0.5}, step=3)
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]


def test_a_run_keeps_only_the_steps_before_its_start(tmp_path):
    _log_steps(Tracker(["jsonl", "console"], "proj", "exp", str(tmp_path), CONFIG))
    with Tracker("jsonl", "proj", "exp", str(tmp_path), CONFIG) as tracker:  # resumed from step 1
        tracker.drop_after(1)
        tracker.log({"critic/score/mean": 0.875}, step=2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 0.25), (2, 0.875)]
    with Tracker("jsonl", "proj", "exp", str(tmp_path), CONFIG) as tracker:  # a fresh run, same folder
        tracker.drop_after(-1)
        tracker.log({"critic/score/mean": 0.0}, step=1)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"step": 1, "critic/score/mean": 0.0}']


def test_metric_values_are_converted_to_float_once(tmp_path):
    with Tracker(["jsonl"], "proj", "exp", str(tmp_path), CONFIG) as tracker:
        tracker.log({"a": np.float32(0.5), "b": torch.tensor(2.0), "c": 3}, step=np.int64(7))
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 7, "a": 0.5,
                                                                   "b": 2.0, "c": 3.0}
    with Tracker(["jsonl"], "proj", "exp", str(tmp_path), CONFIG) as tracker:
        with pytest.raises(TypeError, match="metric 'name' must be a number"):
            tracker.log({"name": "qwen"}, step=1)


def test_console_prints_aligned_table_of_headline_metrics(tmp_path, capsys):
    _log_steps(Tracker(["console"], "proj", "exp", str(tmp_path), CONFIG))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # header + one row per step
    header, row1, row2 = (line.split() for line in lines)
    assert header == ["step", "score", "val_score", "resp_len", "pg_loss", "grad_norm", "step_s"]
    assert row1 == ["1", "0.25", "-", "31.5", "-0.125", "-", "-"]
    assert row2 == ["2", "0.5", "0.75", "28", "0.0625", "-", "-"]
    # Columns line up: every value ends where its title ends.
    assert len({len(line) for line in lines}) == 1
    assert not (tmp_path / "metrics.jsonl").exists()  # console alone writes no file


def test_recipes_always_write_metrics_jsonl(tmp_path):
    """verl-style ``trainer.logger=[console,tensorboard]`` leaves jsonl out; the recipes' plot
    and the user's record of the run still need metrics.jsonl."""
    assert with_jsonl(["console", "tensorboard"]) == ["console", "tensorboard", "jsonl"]
    assert with_jsonl("console") == ["console", "jsonl"]
    assert with_jsonl(["jsonl", "console"]) == ["jsonl", "console"]
    _log_steps(Tracker(with_jsonl(["console"]), "proj", "exp", str(tmp_path), CONFIG))
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_unknown_logger_lists_valid_names(tmp_path):
    with pytest.raises(ValueError, match="unknown logger.*'neptune'") as err:
        Tracker(["console", "neptune"], "proj", "exp", str(tmp_path), CONFIG)
    for name in BACKENDS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="twice"):
        Tracker(["jsonl", "jsonl"], "proj", "exp", str(tmp_path), CONFIG)


def test_missing_package_names_the_extra_and_closes_opened_backends(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"'wandb' needs the wandb package: pip install "
                                          r"'hybridflow\[loggers\]'"):
        Tracker(["jsonl", "wandb"], "proj", "exp", str(tmp_path), CONFIG)
    # The jsonl backend opened before the failure was closed, not leaked.
    jsonl_files = [f for f in _open_files() if f.endswith("metrics.jsonl")]
    assert jsonl_files == []


def _open_files():
    import psutil
    return [f.path for f in psutil.Process().open_files()]


def test_hydra_config_is_resolved_before_backends_see_it(tmp_path):
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = OmegaConf.create({"trainer": {"total_epochs": 2, "total_steps": "${trainer.total_epochs}"}})
    tracker = Tracker(["tensorboard"], "proj", "exp", str(tmp_path), cfg)
    tracker.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"total_steps": 2' in text


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _log_steps(Tracker(["tensorboard"], "proj", "exp", str(tmp_path), CONFIG))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (s, m[key]) for s, m in STEPS.items()]
    assert [(e.step, e.value) for e in events.Scalars("val/score/mean")] == [(2, 0.75)]


def test_mlflow_run_has_params_and_metric_history(tmp_path):
    from mlflow.tracking import MlflowClient
    tracker = Tracker(["mlflow"], "proj", "exp", str(tmp_path), CONFIG)
    backend = tracker.backends["mlflow"]
    _log_steps(tracker)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = client.get_run(backend.run_id)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params == {k: str(v) for k, v in flatten_config(CONFIG).items()}
    assert run.data.params["algorithm.kl_ctrl.kl_coef"] == "0.001"
    history = client.get_metric_history(backend.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5)]
    # "@" is not allowed in MLflow names: it is replaced, the value kept.
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id,
                                                                 "val/pass_1")] == [(2, 0.5)]


def test_mlflow_tracking_uri_in_the_environment_wins(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = Tracker(["mlflow"], "proj", "exp", str(tmp_path / "run"), CONFIG)
    backend = tracker.backends["mlflow"]
    _log_steps(tracker)
    run = MlflowClient(tracking_uri=uri).get_run(backend.run_id)
    assert run.info.status == "FINISHED" and not (tmp_path / "run" / "mlruns").exists()


def _wandb_records(path):
    """Records of a .wandb file: a LevelDB-style log (7-byte file header, 32 KiB blocks, each
    record chunk prefixed by crc32/len/type) of `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto import wandb_internal_pb2
    data, block, pos, chunk, records = open(path, "rb").read(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk ends a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_holds_config_and_history(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _log_steps(Tracker(["wandb"], "proj", "exp", str(tmp_path), CONFIG))
    run_files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1
    records = _wandb_records(run_files[0])
    assert [r.WhichOneof("record_type") for r in records][-1] == "exit", "file not flushed"
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("proj", "exp")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["algorithm"] == CONFIG["algorithm"]
    # wandb stores some keys in `nested_key` (the path parts) instead of `key`.
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: v for k, v in h.items() if not k.startswith("_")} for h in history] == [
        STEPS[1], STEPS[2]]
    assert [h["_step"] for h in history] == [1, 2]


def test_a_logger_whose_package_is_missing_is_named_before_ray(monkeypatch):
    """The config check imports each requested backend's package: a missing one used to fail
    after the workers had loaded the model."""
    import sys

    from hybridflow.tracking.tracker import backend_import_errors

    monkeypatch.setitem(sys.modules, "wandb", None)  # what a missing package looks like to import
    assert backend_import_errors(["console", "jsonl", "wandb", "wandb"]) == [
        "trainer.logger 'wandb' needs the wandb package (ModuleNotFoundError: import of wandb halted; None in sys.modules): "
        "pip install 'hybridflow[loggers]' (or pip install wandb)"]
    assert backend_import_errors(["console", "tensorboard"]) == []
