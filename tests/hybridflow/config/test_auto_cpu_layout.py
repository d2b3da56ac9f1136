"""trainer.n_gpus_per_node=auto: on a CPU host, replicated workers or one worker with every core,
whichever the placement cost model predicts faster (the prediction is stubbed here: calibrating
takes ~30 s; the e2e bench runs the real one); explicit settings are kept; a GPU gets its count."""
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from hybridflow import auto_cpu_layout
from hybridflow.config import ConfigError, load_config
from hybridflow.config import resolve as resolve_mod
from hybridflow.config.resolve import say_once
from hybridflow.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), "qwen2", tied=True)


def rl(model, predicted, monkeypatch, cores=2, **trainer):
    """load_config on a CPU host of ``cores`` cores whose layouts are predicted as ``predicted``
    ({(workers, threads): s}); returns the config and the layouts asked about."""
    asked = []

    def predict(cfg, workers, threads):
        asked.append((workers, threads))
        return predicted[(workers, threads)]

    monkeypatch.setattr(resolve_mod, "predict_layout_step_s", predict)
    say_once.cache_clear()
    return load_config({"actor_rollout_ref": {"model": {"path": model}}, "ray_init": {"num_cpus": cores},
                        "trainer": {"device": "cpu", **trainer}}), asked


def test_the_candidates_are_replicas_of_cpus_per_worker_and_one_worker_with_every_core():
    assert auto_cpu_layout.candidates(2, 1.0) == [(2, 1), (1, 2)]
    assert auto_cpu_layout.candidates(8, 2.0) == [(4, 2), (1, 8)]
    assert auto_cpu_layout.candidates(2, 2.0) == [(1, 2)]  # one replica: nothing to choose


def test_the_faster_prediction_wins_and_a_near_tie_goes_to_one_worker():
    assert auto_cpu_layout.choose({(2, 1): 3.0, (1, 2): 2.5})[0] == (1, 2)
    best, why = auto_cpu_layout.choose({(2, 1): 2.0, (1, 2): 2.5})
    assert best == (2, 1) and why == "predicted 2.00 s/step against 1 worker x 2 threads 2.50 s"
    assert auto_cpu_layout.choose({(2, 1): 2.0, (1, 2): 2.03})[0] == (1, 2)


def test_auto_on_cpu_runs_the_predicted_layout_says_why_and_equals_setting_it(tiny, monkeypatch, capsys):
    cfg, asked = rl(tiny, {(2, 1): 3.4, (1, 2): 2.9}, monkeypatch, n_gpus_per_node="auto")
    assert sorted(asked) == [(1, 2), (2, 1)]
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.cpus_per_worker) == (1, 2.0)
    err = capsys.readouterr().err
    assert ("n_gpus_per_node=auto -> 1 worker x 2 threads (n_gpus_per_node=1, cpus_per_worker=2): predicted "
            "2.90 s/step against 2 workers x 1 thread 3.40 s.") in err
    # the run is the explicit layout's: same resolved config (fsdp_size, dtypes...), so the same numbers trained
    explicit, _ = rl(tiny, {}, monkeypatch, n_gpus_per_node=1, cpus_per_worker=2)
    assert asdict(cfg) == asdict(explicit)

    cfg, _ = rl(tiny, {(2, 1): 2.0, (1, 2): 2.9}, monkeypatch, n_gpus_per_node="auto")
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.cpus_per_worker) == (2, 1.0)
    assert cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == 1  # fsdp_size=auto then sees 2 workers
    assert asdict(cfg) == asdict(rl(tiny, {}, monkeypatch, n_gpus_per_node=2)[0])


def test_explicit_settings_win_and_a_cluster_is_not_sized_here(tiny, monkeypatch):
    for given in (1, 2):  # nothing is predicted: {} would raise KeyError if asked
        cfg, asked = rl(tiny, {}, monkeypatch, n_gpus_per_node=given)
        assert cfg.trainer.n_gpus_per_node == given and cfg.trainer.cpus_per_worker == 1.0 and asked == []
    cfg, asked = rl(tiny, {}, monkeypatch, n_gpus_per_node="auto", cpus_per_worker=2)  # one replica fits
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.cpus_per_worker, asked) == (1, 2.0, [])
    with pytest.raises(ConfigError, match="n_gpus_per_node=auto sizes this machine, but ray_init.address"):
        load_config({"actor_rollout_ref": {"model": {"path": tiny}}, "ray_init": {"address": "auto"},
                     "trainer": {"device": "cpu", "n_gpus_per_node": "auto"}})


def test_on_a_gpu_node_auto_is_its_gpu_count():
    trainer, said = SimpleNamespace(n_gpus_per_node="auto", cpus_per_worker=1.0), []
    auto_cpu_layout.resolve(trainer, 16, False, lambda: True, lambda: 8, None, said.append)
    assert trainer.n_gpus_per_node == 8 and said == ["n_gpus_per_node=auto -> 8: one worker per GPU of this node."]
