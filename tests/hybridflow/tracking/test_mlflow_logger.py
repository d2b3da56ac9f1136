"""One output folder is one MLflow run: a resumed run continues it, a fresh start makes a new one."""
import json

from mlflow.tracking import MlflowClient

from hybridflow.tracking import Tracker
from hybridflow.tracking.mlflow_logger import RUN_FILE

CONFIG = {"trainer": {"total_epochs": 2}, "algorithm": {"adv_estimator": "grpo"}}


def _attempt(out_dir, steps, scale, drop_after=None, config=CONFIG) -> str:
    with Tracker(["mlflow"], "proj", "exp", str(out_dir), config) as tracker:
        backend = tracker.backends["mlflow"]
        if drop_after is not None:
            tracker.drop_after(drop_after)
        for step in steps:
            tracker.log({"critic/score/mean": step * scale}, step=step)
    return backend.run_id


def _runs(client):
    experiment = client.get_experiment_by_name("proj")
    return client.search_runs([experiment.experiment_id], run_view_type=3)  # ViewType.ALL


def _history(client, run_id):
    points = client.get_metric_history(run_id, "critic/score/mean")
    return sorted((m.step, m.timestamp, m.value) for m in points)


def test_a_resumed_run_continues_the_mlflow_run_and_a_fresh_start_makes_a_new_one(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    first = _attempt(tmp_path, range(1, 5), 1.0)  # killed after logging step 4; checkpoint at 2
    resumed_config = {"trainer": {"total_epochs": 3, "total_training_steps": 8},
                      "algorithm": {"adv_estimator": "grpo"}}
    assert _attempt(tmp_path, (3, 4), 10.0, drop_after=2, config=resumed_config) == first

    assert [r.info.run_id for r in _runs(client)] == [first]
    run = client.get_run(first)
    assert run.info.status == "FINISHED" and run.data.tags["resumed_after_step"] == "2"
    # a logged param keeps its value, the change is a tag; a new key is a param
    assert run.data.params["trainer.total_epochs"] == "2"
    assert run.data.tags["changed_param.trainer.total_epochs"] == "3"
    assert run.data.params["trainer.total_training_steps"] == "8"
    # MLflow keeps the killed attempt's points past the checkpoint; the resumed ones come later
    history = _history(client, first)
    assert [(step, value) for step, _, value in history if step <= 2] == [(1, 1.0), (2, 2.0)]
    for step in (3, 4):
        points = sorted((t, v) for s, t, v in history if s == step)
        assert {v for _, v in points} == {step * 1.0, step * 10.0} and points[-1][0] >= points[0][0]

    fresh = _attempt(tmp_path, (1,), -1.0, drop_after=-1)
    assert fresh != first and len(_runs(client)) == 2
    assert json.loads((tmp_path / RUN_FILE).read_text()) == {"run_id": fresh}
    assert _history(client, fresh)[0][::2] == (1, -1.0)
    # without drop_after (trainer.val_only), the folder's run gets the scores
    assert _attempt(tmp_path, (1,), 5.0) == fresh

    client.delete_run(fresh)  # a recorded run that is gone is not continued
    again = _attempt(tmp_path, (2,), 1.0, drop_after=1)
    assert again not in (first, fresh) and client.get_run(again).info.lifecycle_stage == "active"


def test_a_changed_param_tag_goes_when_the_value_is_back(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run_id = _attempt(tmp_path, (1,), 1.0)
    _attempt(tmp_path, (2,), 1.0, drop_after=1, config={**CONFIG, "trainer": {"total_epochs": 3}})
    assert client.get_run(run_id).data.tags["changed_param.trainer.total_epochs"] == "3"
    _attempt(tmp_path, (3,), 1.0, drop_after=2)
    assert "changed_param.trainer.total_epochs" not in client.get_run(run_id).data.tags


def test_the_run_is_recorded_next_to_the_output_with_a_tracking_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "run"
    first = _attempt(out, (1, 2), 1.0, drop_after=-1)
    assert _attempt(out, (2, 3), 2.0, drop_after=1) == first
    assert json.loads((out / RUN_FILE).read_text()) == {"run_id": first}
    assert not (out / "mlruns").exists()
    assert len(_runs(MlflowClient(tracking_uri=uri))) == 1
