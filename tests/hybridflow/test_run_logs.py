"""A quiet run: what reaches the console, what goes to the run's log folder, and the switch back."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from hybridflow import run_logs

QUIET = {"HYBRIDFLOW_VERBOSE": "", "VERL_LOGGING_LEVEL": ""}


@pytest.mark.parametrize("environ, expected", [
    ({}, False), ({"HYBRIDFLOW_VERBOSE": "1"}, True), ({"HYBRIDFLOW_VERBOSE": "true"}, True),
    ({"HYBRIDFLOW_VERBOSE": "0"}, False), ({"VERL_LOGGING_LEVEL": "INFO"}, True),
    ({"VERL_LOGGING_LEVEL": "debug"}, True), ({"VERL_LOGGING_LEVEL": "WARN"}, False),
])
def test_verbose_is_ours_or_verls_switch(environ, expected):
    assert run_logs.verbose(environ) is expected


def test_the_runtime_env_sends_workers_to_the_run_folder_unless_verbose(tmp_path):
    runtime = run_logs.ray_runtime_env(str(tmp_path / "run"), environ={})
    assert runtime["worker_process_setup_hook"] == "hybridflow.run_logs.redirect_worker_output"
    assert runtime["env_vars"] == {"HYBRIDFLOW_LOG_DIR": str(tmp_path / "run" / "logs"), "VLLM_CONFIGURE_LOGGING": "0"}
    # a relative run folder is made absolute: workers do not run in the driver's directory
    assert os.path.isabs(run_logs.ray_runtime_env("runs/x", environ={})["env_vars"]["HYBRIDFLOW_LOG_DIR"])
    # the user's own vLLM logging setting is kept
    assert run_logs.ray_runtime_env("r", environ={"VLLM_CONFIGURE_LOGGING": "1"})["env_vars"]["VLLM_CONFIGURE_LOGGING"] == "1"
    assert run_logs.ray_runtime_env("r", environ={"HYBRIDFLOW_VERBOSE": "1"}) == {}


def test_worker_log_names():
    assert run_logs.worker_log_name({"HYBRIDFLOW_GROUP": "main", "RANK": "1"}) == "main_rank1.log"
    assert run_logs.worker_log_name({"HYBRIDFLOW_GROUP": "a/b c", "RANK": "0"}) == "a_b_c_rank0.log"
    assert run_logs.worker_log_name({"RANK": "0"}) == run_logs.TASKS_LOG  # a plain Ray task's process


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_only_warnings_a_user_must_act_on_are_console_worthy():
    assert not run_logs.is_console_worthy(_record("vllm.engine", logging.INFO, "Initializing a V1 LLM engine"))
    assert not run_logs.is_console_worthy(_record("vllm.v1.worker.cpu_worker", logging.WARNING,
                                                  "libtcmalloc is not found in LD_PRELOAD. For best performance"))
    assert not run_logs.is_console_worthy(_record("ray._private.authentication", logging.WARNING,
                                                  "Token authentication is enabled for this Ray cluster."))
    assert run_logs.is_console_worthy(_record("vllm.engine", logging.WARNING, "max_model_len is too large"))
    # a bf16 engine over an fp32 checkpoint casts on load (our rollout.dtype=auto); other casts still show
    cast = "Attempted to load weight norm.weight with dtype torch.float32 into parameter with dtype torch.{}"
    assert not run_logs.is_console_worthy(_record("vllm.model_executor.models.utils", logging.WARNING,
                                                  cast.format("bfloat16")))
    assert run_logs.is_console_worthy(_record("vllm.model_executor.models.utils", logging.WARNING,
                                              cast.format("float16")))
    assert run_logs.is_console_worthy(_record("workers.rollout.vllm_rollout", logging.WARNING, "loaded nothing"))
    assert run_logs.is_console_worthy(_record("vllm.engine", logging.ERROR, "engine failed"))
    # a harmless text from another library than the one it is known from still shows
    assert run_logs.is_console_worthy(_record("vllmx", logging.WARNING, "libiomp is not found in LD_PRELOAD"))


WORKER = textwrap.dedent("""
    import logging, os, sys
    from hybridflow.run_logs import redirect_worker_output
    print("before", flush=True)
    redirect_worker_output()
    print("python print")
    sys.stdout.flush()
    os.write(2, b"C-level write to fd 2\\n")
    logging.getLogger("vllm.engine").info("Initializing a V1 LLM engine")
    logging.getLogger("vllm.worker").warning("libiomp is not found in LD_PRELOAD")
    logging.getLogger("workers.rollout").warning("vLLM weight sync loaded nothing into 2 parameters")
""")


def test_a_worker_writes_everything_to_its_file_and_only_real_warnings_to_the_console(tmp_path):
    """The setup hook in a process of its own (it replaces the process's stdout and stderr)."""
    folder = tmp_path / "logs"
    env = {**os.environ, **QUIET, "HYBRIDFLOW_LOG_DIR": str(folder), "HYBRIDFLOW_GROUP": "main", "RANK": "1"}
    for _ in range(2):  # a resumed run appends to the same file
        done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "before\n"
        assert done.stderr == "[main_rank1] WARNING workers.rollout: vLLM weight sync loaded nothing into 2 parameters\n"
    text = (folder / "main_rank1.log").read_text()
    assert text.count("==== ") == 2, text
    for line in ("python print", "C-level write to fd 2", "INFO vllm.engine: Initializing a V1 LLM engine",
                 "WARNING vllm.worker: libiomp is not found", "WARNING workers.rollout: vLLM weight sync"):
        assert text.count(line) == 2, (line, text)


def test_without_a_log_folder_the_hook_changes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDFLOW_LOG_DIR"}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert "python print" in done.stdout and "C-level write to fd 2" in done.stderr


def test_the_driver_keeps_rays_info_in_the_run_folder_while_the_run_lasts(tmp_path, monkeypatch):
    import io

    from ray._private.log import PlainRayHandler  # importing Ray gives its logger this console handler

    for key, value in QUIET.items():
        monkeypatch.setenv(key, value)
    # Ray's console handler keeps the sys.stderr of the moment Ray was first imported (under
    # pytest, some capture's): read what it writes from a buffer instead
    console = io.StringIO()
    for handler in logging.getLogger("ray").handlers:
        if isinstance(handler, PlainRayHandler):  # not pytest's own capture handlers
            monkeypatch.setattr(handler, "stream", console)
    log = logging.getLogger("ray._private.worker")
    with run_logs.quiet_driver(str(tmp_path / "run")) as folder:
        assert folder == str(tmp_path / "run" / "logs")
        log.info("Started a local Ray instance.")
        log.warning("Token authentication is enabled for this Ray cluster.")
        log.warning("a warning to act on")
    shown = console.getvalue()
    assert "a warning to act on" in shown and "Started" not in shown and "Token" not in shown, shown
    text = (tmp_path / "run" / "logs" / run_logs.DRIVER_LOG).read_text()
    assert "Started a local Ray instance." in text and "Token authentication" in text and "act on" in text
    log.info("after the run")  # the console handler is Ray's again, unfiltered
    assert "after the run" in console.getvalue()
    assert "after the run" not in (tmp_path / "run" / "logs" / run_logs.DRIVER_LOG).read_text()


def test_verbose_leaves_the_driver_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_VERBOSE", "1")
    with run_logs.quiet_driver(str(tmp_path / "run")) as folder:
        assert folder is None
    assert not (tmp_path / "run").exists()


def test_after_a_worker_died_the_console_gets_its_last_lines_and_the_folder(tmp_path, monkeypatch):
    for key, value in QUIET.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    assert run_logs.after_failure(str(run), ("main", 1)) == []  # no folder: the run wrote no logs
    logs = run / "logs"
    logs.mkdir(parents=True)
    # an earlier process of the rank (a resumed run), then the one that died; Ray's markers between
    (logs / "main_rank1.log").write_text(
        "==== 2026-01-01 10:00:00 pid 1 ====\nold run\n"
        "==== 2026-01-01 11:00:00 pid 2 ====\n:job_id:01000000\n:actor_name:Colocated\n"
        + "".join(f"line {i}\n" for i in range(40)) + "Fatal Python error: Segmentation fault\n")
    path, text = run_logs.last_output(str(logs), "main", 1, lines=3)
    assert path == str(logs / "main_rank1.log") and text == "line 38\nline 39\nFatal Python error: Segmentation fault"
    assert "old run" not in run_logs.last_output(str(logs), "main", 1, lines=100)[1]
    assert run_logs.last_output(str(logs), "main", 0) is None  # no such file
    lines = run_logs.after_failure(str(run), ("main", 1))
    assert lines[0].startswith(f"the last lines of {logs / 'main_rank1.log'}:\n") and lines[0].endswith("Segmentation fault")
    assert lines[1].endswith(f"is in {logs}")
    assert run_logs.after_failure(str(run)) == [lines[1]]  # a rank that raised: its traceback is in the error
    monkeypatch.setenv("HYBRIDFLOW_VERBOSE", "1")
    assert run_logs.after_failure(str(run), ("main", 1)) == []  # it was all on the console
