"""``python -m recipes.main_ppo`` when it must not run or must stop (issue 6's "bad input gets a
clear error and loses nothing"): config and input errors exit in seconds, before Ray starts, in
one line naming the key, file or row; a reward function that raises everywhere, SIGTERM and a
worker killed for memory stop the run with one line naming the last checkpoint and how to resume.
The runs that succeed are in test_main_ppo.py.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.recipes.conftest import run_main_ppo

CONFIG_ERRORS = [
    # (override, text the one-line error must contain)
    ("actor_rollout_ref.actor.ppo_mini_batch_sise=2", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator"),
    ("trainer.n_gpus_per_node=8", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n"),
    # imported in the driver before the model's config is read (and again in each worker)
    ("actor_rollout_ref.model.external_lib=no_such_module_xyz",
     "actor_rollout_ref.model.external_lib='no_such_module_xyz' cannot be imported"),
]


def _one_line_before_ray(code: int, err: str, out: str, label: str, text: str, ray_starts: list = ()) -> None:
    """Exit 2, exactly one ``label:`` line holding ``text``, no traceback, no Ray, no run folder."""
    assert not ray_starts, "Ray started before the input was checked"
    assert code == 2, f"exit {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.startswith(f"{label}:")]
    assert len(lines) == 1 and text in lines[0], err[-3000:]
    assert "Traceback" not in err and "Ray" not in err and not os.path.exists(out), err[-3000:]


@pytest.mark.parametrize("override,key", CONFIG_ERRORS, ids=[o.split("=")[0] for o, _ in CONFIG_ERRORS])
def test_config_error_exits_before_ray(recipe_assets, tmp_path, capsys, ray_starts, override, key):
    """``main()`` in this process (the checks are the same code as the command's; a case that got
    past them would start Ray here, and the assertion says so). The command itself, timed, is
    test_the_command_fails_on_a_config_error_in_seconds."""
    from recipes.main_ppo import main

    out = str(tmp_path / "run")
    code = main(["--config-name", "grpo", *recipe_assets.overrides(out), "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", override])
    _one_line_before_ray(code, capsys.readouterr().err, out, "config error", key, ray_starts)


@pytest.mark.slow
def test_the_command_fails_on_a_config_error_in_seconds(recipe_assets, tmp_path):
    """``python -m recipes.main_ppo`` as a user runs it: nothing heavy (Ray, vLLM, a model) starts
    before the config is checked. The external_lib case also shows the import happens in the
    driver before the model's config is read."""
    override, key = CONFIG_ERRORS[-1]
    out = str(tmp_path / "run")
    t0 = time.perf_counter()
    result = run_main_ppo("grpo", recipe_assets.overrides(out) + [
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", override], timeout=120)
    elapsed = time.perf_counter() - t0
    _one_line_before_ray(result.returncode, result.stderr, out, "config error", key)
    assert elapsed < 25, f"config error took {elapsed:.1f}s: did something heavy start first?"


def _jsonl_with_a_row_missing_its_prompt(path) -> str:
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(8)]
    del rows[5]["prompt"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_data_source_without_a_built_in_reward_is_named_before_ray(tmp_path):
    from types import SimpleNamespace

    from hybridflow.data import RLPromptDataset
    from hybridflow.data.dataset import DataError
    from hybridflow.tiny import make_char_tokenizer
    from recipes.main_ppo import _check_built_in_rewards

    rows = [{"data_source": source, "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}
            for source in ("arithmetic", "openai/gsm8k", "my_task")]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = RLPromptDataset(str(path), make_char_tokenizer(), max_prompt_length=8)
    with pytest.raises(DataError, match=r"data.val_files: no built-in reward for data_source \['my_task'\]"):
        _check_built_in_rewards(SimpleNamespace(reward_fn_key="data_source"), None, ds)


@pytest.mark.parametrize("case", ["bad_row", "reward_name", "batch_over_data"])
def test_input_error_exits_before_ray_in_one_line(recipe_assets, tmp_path, capsys, ray_starts, case):
    """Inputs that only reading them can check (a data row, the reward function's name, the data
    set's size) fail like config errors: exit 2, one line naming the file/row/key, no Ray."""
    from recipes.main_ppo import main

    out = str(tmp_path / "run")
    extra, label, text = {
        "bad_row": ([f"data.train_files=[{_jsonl_with_a_row_missing_its_prompt(tmp_path / 'bad.jsonl')}]"],
                    "data error", "bad.jsonl: row 5: key 'prompt' is missing"),
        "reward_name": (["custom_reward_function.name=not_there"], "config error",
                        "custom_reward_function.name: 'not_there' is not defined"),
        "batch_over_data": (["data.train_batch_size=128", "actor_rollout_ref.actor.ppo_mini_batch_size=128"],
                            "data error", "fewer than one batch of 128: lower data.train_batch_size"),
    }[case]
    code = main(["--config-name", "grpo", *recipe_assets.overrides(out), "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *extra])
    _one_line_before_ray(code, capsys.readouterr().err, out, label, text, ray_starts)


def test_resuming_with_other_data_is_refused_before_ray_and_val_only_ignores_it(recipe_assets, tmp_path):
    """A checkpoint whose data loader saw another data set (here: 40 prompts, as with
    data.train_max_samples=40) is refused while reading the inputs, naming the folder; an
    evaluation (trainer.val_only) of the same checkpoint does not need the training data's order."""
    import json

    from hybridflow.trainer import checkpoint as ckpt
    from hybridflow.trainer.ppo_trainer import worker_layout
    from recipes.main_ppo import load_and_validate, read_inputs

    out = tmp_path / "run"
    cfg = load_and_validate(["--config-name", "grpo", *recipe_assets.overrides(str(out))])
    path = ckpt.step_dir(str(out), 2)
    os.makedirs(path)
    loader = {"epoch": 0, "batch_in_epoch": 2, "seed": cfg.data.seed, "batch_size": cfg.data.train_batch_size,
              "dataset_size": 40, "shuffle": cfg.data.shuffle, "drop_last": True}
    ckpt.write_atomically(os.path.join(path, ckpt.TRAINER_STATE),
                          json.dumps({"global_step": 2, "loader": loader, "rng": ckpt.controller_rng_state()}))
    ckpt.write_manifest(path, 2, worker_layout(cfg))
    ckpt.write_tracker(str(out), 2)
    with pytest.raises(ckpt.CheckpointError, match=r"global_step_2: cannot resume the data loader: checkpoint "
                                                   r"has dataset_size=40"):
        read_inputs(cfg)
    cfg.trainer.val_only = True
    assert read_inputs(cfg).train_loader.batch_in_epoch == 0

@pytest.mark.slow
def test_reward_function_raising_everywhere_stops_the_run_and_names_the_checkpoint(recipe_assets, tmp_path):
    """A broken reward function (raises on every sample) ends the run at its first scored batch with
    one line, and the last line says what there is to resume from (here: nothing yet)."""
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise RuntimeError('grader offline')\n")
    out = str(tmp_path / "run")
    result = run_main_ppo("grpo", recipe_assets.overrides(out) + [
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", f"custom_reward_function.path={broken}",
        "trainer.val_before_train=false",
        # the stop does not depend on the generation backend: transformers' starts faster than vLLM
        "actor_rollout_ref.rollout.name=hf",
        "reward_model.launch_reward_fn_async=true"])  # raised in the reward process: the same one line
    assert result.returncode == 1, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith(("reward function error:", "the run stopped"))]
    assert len(ours) == 2, result.stderr[-3000:]
    assert "raised on all 16 samples of a batch, first RuntimeError: grader offline" in ours[0]
    assert ours[1] == (f"the run stopped before its first checkpoint (trainer.save_freq=-1); "
                       f"nothing to resume from in {out}")


def test_last_checkpoint_line_names_the_folder_and_how_to_resume(tmp_path):
    from types import SimpleNamespace

    from hybridflow.trainer.checkpoint import TRAINER_STATE, step_dir, write_atomically, write_manifest, write_tracker
    from recipes.main_ppo import last_checkpoint_line

    def cfg(resume_mode="auto"):
        return SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path), save_freq=2,
                                                       resume_mode=resume_mode))

    assert "before its first checkpoint (trainer.save_freq=2)" in last_checkpoint_line(cfg())
    os.makedirs(step_dir(str(tmp_path), 4))  # a complete (verifying) checkpoint: the line names only those
    write_atomically(os.path.join(step_dir(str(tmp_path), 4), TRAINER_STATE), "{}")
    write_manifest(step_dir(str(tmp_path), 4), 4, {})
    write_tracker(str(tmp_path), 4)
    assert last_checkpoint_line(cfg()) == (f"the run stopped; its last complete checkpoint is "
                                           f"{tmp_path}/global_step_4: run the same command again to resume from it")
    assert last_checkpoint_line(cfg("disable")).endswith("run again with trainer.resume_mode=auto to resume from it")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("oops")
    assert "is corrupted" in last_checkpoint_line(cfg())


def test_sigterm_that_surfaces_wrapped_in_another_error_still_stops_as_terminated(tmp_path, capsys):
    """SIGTERM's handler can run inside Ray's own code (deserialising a result), which wraps what
    it raises (RaySystemError): the stop is still reported as the signal's, exit 143."""
    import signal
    from types import SimpleNamespace

    from recipes.main_ppo import Terminated, report_stop, restore_sigterm, stop_on_sigterm

    cfg = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path), save_freq=2, resume_mode="auto"))
    previous = stop_on_sigterm()
    try:
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode
    finally:
        restore_sigterm(previous)
    assert report_stop(cfg, RuntimeError("System error: stopped by SIGTERM")) == 143
    err = capsys.readouterr().err
    assert err.startswith("stopped by SIGTERM\n") and "Traceback" not in err
    stop_on_sigterm_again = stop_on_sigterm()  # a new run forgets the last one's signal
    restore_sigterm(stop_on_sigterm_again)
    assert report_stop(cfg, RuntimeError("a real failure")) == 1


def test_a_worker_killed_for_memory_stops_in_one_line_naming_the_keys(tmp_path, capsys):
    """No traceback (the code did nothing wrong): what happened with Ray's numbers, the keys that
    lower a worker's memory in this recipe, then the checkpoint line."""
    from hybridflow.config import load_config
    from hybridflow.config.sft import load_sft_config
    from hybridflow.controller import WorkerMemoryError
    from recipes.cli import compose_config
    from recipes.main_ppo import report_stop

    err = WorkerMemoryError("actor: rank 1 was killed for lack of host memory during update_actor "
                            "(Memory on the node was 22.63GB used / 23.54GB limit)")
    ppo = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path}"]))
    assert report_stop(ppo, err) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in lines[0]
    assert lines[0].startswith("out of memory: actor: rank 1 was killed for lack of host memory during update_actor")
    for key in ("actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.kv_cache_gib",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"):
        assert key in lines[0]
    assert lines[1].startswith("the run stopped before its first checkpoint")

    sft = load_sft_config(compose_config("sft", [f"trainer.default_local_dir={tmp_path}"]))
    report_stop(sft, err)
    first = capsys.readouterr().err.splitlines()[0]
    assert "data.micro_batch_size_per_gpu" in first and "actor_rollout_ref" not in first


def test_a_worker_that_died_stops_with_its_last_lines_from_its_log_file(tmp_path, capsys, monkeypatch):
    """In a quiet run a worker's stderr goes to its file (hybridflow/run_logs.py): after the
    traceback the console gets what the dead rank wrote last, and where all the logs are."""
    from hybridflow.config import load_config
    from hybridflow.controller import WorkerGroupError
    from recipes.cli import compose_config
    from recipes.main_ppo import report_stop

    monkeypatch.delenv("HYBRIDFLOW_VERBOSE", raising=False)
    monkeypatch.delenv("VERL_LOGGING_LEVEL", raising=False)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "main_rank1.log").write_text("==== 2026-01-01 10:00:00 pid 7 ====\n:actor_name:x\n"
                                                      "Fatal Python error: Segmentation fault\n")
    err = WorkerGroupError("main/actor_rollout_ref: rank 1 died during update_actor (The actor died unexpectedly)")
    err.died = ("main", 1)
    cfg = load_config(compose_config("grpo", [f"trainer.default_local_dir={tmp_path}"]))
    capsys.readouterr()  # what loading the config says
    assert report_stop(cfg, err) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    at = lines.index(f"the last lines of {tmp_path / 'logs' / 'main_rank1.log'}:")
    assert "rank 1 died during update_actor" in lines[at - 1]  # the error's traceback comes first
    assert lines[at + 1:] == ["Fatal Python error: Segmentation fault",
                              f"the workers' own output (vLLM, Ray, stdout and stderr of each rank) is in {tmp_path / 'logs'}",
                              "the run stopped before its first checkpoint (trainer.save_freq=-1); nothing to resume "
                              f"from in {tmp_path}"]


@pytest.mark.slow
def test_sigterm_stops_the_run_and_names_the_last_checkpoint(recipe_assets, tmp_path):
    """``scancel`` or a Slurm time limit sends SIGTERM: the driver stops the workers and says
    which checkpoint to resume from (before, Ray's handler exited with nothing said). It arrives
    while the reward function runs (a slow grader), which used to take the stop for that sample's
    error, score it 0 and train on."""
    import signal
    import subprocess
    import sys

    from hybridflow.trainer.checkpoint import read_tracker
    from tests.recipes.conftest import REPO

    out = str(tmp_path / "run")
    overrides = [o for o in recipe_assets.overrides(out) if not o.startswith(("trainer.total_training_steps",
                                                                            "trainer.test_freq"))]
    slow_reward = tmp_path / "slow_reward.py"  # once a checkpoint exists: says so, then grades for 50 s
    slow_reward.write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    if os.path.exists({os.path.join(out, 'latest_checkpointed_iteration.txt')!r}) and not "
        f"os.path.exists({str(tmp_path / 'scoring')!r}):\n"
        f"        open({str(tmp_path / 'scoring')!r}, 'w').close()\n"
        "        time.sleep(50)\n"
        "    return 0.0\n")
    overrides += [f"custom_reward_function.path={slow_reward}",
                  "trainer.total_training_steps=1000", "trainer.save_freq=1", "trainer.test_freq=-1",
                  "trainer.val_before_train=false", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                  "actor_rollout_ref.rollout.name=hf",  # transformers' generation starts faster than vLLM
                  "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(tmp_path / "stderr.txt", "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "recipes.main_ppo", "--config-name", "grpo", *overrides],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.monotonic() + 300
            while not os.path.exists(tmp_path / "scoring"):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 143, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert "stopped by SIGTERM" in lines and "reward function" not in stderr, stderr[-3000:]
    step = read_tracker(out)
    # (Ray forwards worker log lines at its own pace, so the line need not be the very last)
    assert step >= 1 and (f"the run stopped; its last complete checkpoint is {out}/global_step_{step}: "
                          "run the same command again to resume from it") in lines, stderr[-3000:]
