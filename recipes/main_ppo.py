"""PPO-family entry point: ``python -m recipes.main_ppo --config-name {ppo,grpo,remax} key=value ...``

Order matters: the config is loaded and validated completely (unknown keys, sizes, names, files,
devices), then the data is read and the reward function imported, all before Ray or any worker
starts, so a typo or a bad data row costs seconds, not a cluster start-up, and exits with one line.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from hybridflow.config import ConfigError, derive, load_config, validate
from hybridflow.config.derived import needs_critic, prompts_per_generation_batch
from hybridflow.controller import WorkerMemoryError
from hybridflow.data.dataset import DataError
from hybridflow.rewards.loader import RewardFunctionError
from hybridflow.run_logs import after_failure, quiet_driver
from hybridflow.trainer.checkpoint import CheckpointError, CheckpointSaveError
from hybridflow.trainer.finite import NonFiniteError
from recipes.cli import cli_info, compose_config, split_cli_args

# what a user's input can be wrong with, and the label of its one-line message
INPUT_ERRORS = {ConfigError: "config error", DataError: "data error", RewardFunctionError: "config error",
                CheckpointError: "checkpoint error"}


def input_error_line(err: Exception) -> str:
    label = next(label for cls, label in INPUT_ERRORS.items() if isinstance(err, cls))
    return f"{label}: {err}"


def available_slots(cfg) -> int | None:
    """Worker slots on this machine: GPUs, or CPU cores / trainer.cpus_per_worker. None when
    joining an existing cluster (Ray checks its resources when the pools are reserved)."""
    if cfg.ray_init.address:
        return None
    from hybridflow import device

    if device.uses_gpu(cfg.trainer.device):
        return device.device_count() * cfg.trainer.nnodes
    return int((cfg.ray_init.num_cpus or os.cpu_count() or 1) / cfg.trainer.cpus_per_worker + 1e-9)


def ray_address_from_env(cfg):
    """Join the cluster in ``RAY_ADDRESS`` when ``ray_init.address`` is unset: Ray's own convention
    (``ray.init()`` reads it), which scripts/slurm and ``ray job submit`` rely on."""
    if not cfg.ray_init.address and os.environ.get("RAY_ADDRESS"):
        cfg.ray_init.address = os.environ["RAY_ADDRESS"]
    return cfg


def load_and_validate(argv, default_config: str = "ppo"):
    name, overrides = split_cli_args(argv, default_config)
    cfg = ray_address_from_env(load_config(compose_config(name, overrides)))
    if cfg.trainer.placement == "auto":  # the planner's choice, as overrides after the user's
        overrides = overrides + planned_placement(name, overrides, cfg)
        cfg = ray_address_from_env(load_config(compose_config(name, overrides)))
    validate(cfg, available_slots=available_slots(cfg))
    return cfg


def planned_placement(name: str, overrides: list[str], cfg) -> list[str]:
    """``trainer.placement=auto``: the overrides of the fastest predicted plan whose config validates
    (hybridflow/placement/auto.py prints it and the alternatives on stderr)."""
    from hybridflow.placement.auto import choose_placement

    def check(planned: list[str]) -> None:
        planned_cfg = ray_address_from_env(load_config(compose_config(name, overrides + planned)))
        validate(planned_cfg, available_slots=available_slots(planned_cfg), check_paths=False)

    return choose_placement(cfg, check)


@dataclass
class RunInputs:
    """What the driver reads from disk before Ray starts."""
    tokenizer: Any
    derived: Any
    train_loader: Any
    val_loader: Any
    reward: Any


def read_inputs(cfg) -> RunInputs:
    """Tokenizer, data sets (every row checked), the reward function, and the checkpoint to resume
    from (complete, saved with this worker layout); raises one of INPUT_ERRORS naming the file,
    row, key or checkpoint when one of them cannot be used."""
    from hybridflow.data import ResumablePromptLoader, RLPromptDataset
    from hybridflow.rewards import make_reward_manager
    from hybridflow.model_checks import weightless_model_error
    from hybridflow.model_files import load_model_tokenizer
    from hybridflow.trainer.checkpoint import open_resume
    from hybridflow.trainer.ppo_trainer import worker_layout

    resume = open_resume(cfg.trainer.default_local_dir, cfg.trainer.resume_mode, worker_layout(cfg))
    # a folder without weight files passed validate() (it checks layouts against config.json alone)
    # and failed a minute later inside a worker
    weightless = weightless_model_error(cfg, needs_critic(cfg))
    if weightless:
        raise ConfigError(weightless)
    data = cfg.data
    # a folder without tokenizer files is named here, not blamed on data row 0 ("tokenizes to no tokens")
    tokenizer = load_model_tokenizer("actor_rollout_ref.model", cfg.actor_rollout_ref.model)
    if cfg.actor_rollout_ref.model.custom_chat_template is not None:
        tokenizer.chat_template = cfg.actor_rollout_ref.model.custom_chat_template
    train_ds = RLPromptDataset.from_config(data.train_files, tokenizer, data, data.train_max_samples)
    val_ds = (RLPromptDataset.from_config(data.val_files, tokenizer, data, data.val_max_samples)
              if data.val_files else None)
    train_loader = ResumablePromptLoader(train_ds, prompts_per_generation_batch(cfg), shuffle=data.shuffle,
                                         seed=data.seed)
    if resume is not None and not cfg.trainer.val_only:  # the data order must be the checkpointed run's
        try:
            train_loader.load_state_dict(resume[1]["loader"])
        except ValueError as err:
            raise CheckpointError(f"{resume[0]}: {err}") from err
    val_loader = (ResumablePromptLoader(val_ds, data.val_batch_size or len(val_ds), shuffle=False, drop_last=False)
                  if val_ds is not None else None)
    if not cfg.custom_reward_function.path and not cfg.reward_model.enable:
        _check_built_in_rewards(data, train_ds, val_ds)
    overlong = cfg.reward_model.overlong_buffer
    crf = cfg.custom_reward_function
    reward = make_reward_manager(crf.path, crf.name, crf.reward_kwargs, manager=cfg.reward_model.reward_manager,
                                 overlong_buffer=(overlong.len, overlong.penalty_factor) if overlong.enable else None,
                                 timeout_s=crf.timeout_s)
    return RunInputs(tokenizer, derive(cfg, dataset_len=len(train_ds)), train_loader, val_loader, reward)


def _check_built_in_rewards(data, train_ds, val_ds) -> None:
    """Without a reward function of the user's, every row's data source needs a built-in scorer:
    found out here, not when the first batch holding one is scored."""
    from hybridflow.data.dataset import DataError
    from hybridflow.rewards import RULE_SCORERS

    for key, ds in (("data.train_files", train_ds), ("data.val_files", val_ds)):
        unknown = sorted(map(str, ds.data_sources() - set(RULE_SCORERS))) if ds is not None else []
        if unknown:
            raise DataError(f"{key}: no built-in reward for {data.reward_fn_key} {unknown} (known: "
                            f"{sorted(RULE_SCORERS)}): set custom_reward_function.path to a file defining "
                            "compute_score(data_source, solution_str, ground_truth, extra_info=None)")


def run(cfg, inputs: RunInputs | None = None) -> dict:
    """Start Ray, build the worker groups, train, export; returns a summary dict. vLLM's, Ray's and
    the workers' own output goes to the run's log folder, the summary's ``logs`` (None when
    HYBRIDFLOW_VERBOSE keeps it on the console: hybridflow/run_logs.py)."""
    inputs = inputs or read_inputs(cfg)  # before the log folder exists: a bad input leaves no trace
    with quiet_driver(cfg.trainer.default_local_dir) as logs:
        return {**_run(cfg, inputs), "logs": logs}


def _run(cfg, inputs: RunInputs) -> dict:
    from hybridflow import device
    from hybridflow.tracking import Tracker, flatten_config, plot_metrics, with_jsonl
    from hybridflow.tracking.jsonl_logger import METRICS_FILE
    from hybridflow.trainer.placement import build_worker_groups
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from recipes.build import role_specs
    from recipes.ray_start import start_ray
    from recipes.worker_env import ray_runtime_env

    t = cfg.trainer
    tokenizer, derived, reward = inputs.tokenizer, inputs.derived, inputs.reward
    train_loader, val_loader = inputs.train_loader, inputs.val_loader

    use_gpu = device.uses_gpu(cfg.trainer.device)
    start_ray(cfg.ray_init, ray_runtime_env(cfg, cfg.actor_rollout_ref.model.path))
    trace = cfg.ray_kwargs.timeline_json_file
    try:  # the trace is written whatever happens after Ray starts, start-up failures included
        previous_sigterm = stop_on_sigterm()
        main_roles, side_roles = role_specs(cfg, derived)
        groups, pools = build_worker_groups(cfg, main_roles, side_roles, use_gpu)
        for role in ("actor_rollout_ref", "ref", "critic", "reward_model", "rollout"):
            if role in groups:
                groups[role].init_model()

        os.makedirs(t.default_local_dir, exist_ok=True)
        tracker = Tracker(with_jsonl(t.logger), t.project_name, t.experiment_name, t.default_local_dir,
                          flatten_config(asdict(cfg)))
        trainer = PPOTrainer(cfg, groups, tokenizer, train_loader, val_loader, reward, tracker,
                             progress=sys.stderr.isatty() or bool(os.environ.get("HYBRIDFLOW_PROGRESS")))
        try:
            history = trainer.fit()
            hf_dir = None if t.val_only else os.path.join(t.default_local_dir, "hf")
            if hf_dir:
                groups["actor_rollout_ref"].save_hf(hf_dir)
            plot = plot_metrics(os.path.join(t.default_local_dir, METRICS_FILE),
                                os.path.join(t.default_local_dir, "reward_curve.png"))
        finally:
            try:
                tracker.finish()
                trace = write_ray_timeline(trace)  # before the actors go: their last events go with them
            finally:  # a failing tracker must not leave the reward function's child processes behind
                trainer.timeline.write(t.default_local_dir)  # trainer.timeline; before the workers go
                trainer.close()
                for group in {id(g._actors[0]): g for g in groups.values()}.values():
                    group.shutdown()
                for pool in pools:
                    pool.release()
                restore_sigterm(previous_sigterm)
        return {"history": history, "hf_dir": hf_dir, "plot": plot, "steps": trainer.global_step}
    finally:
        reward.close()  # its scoring child, also where the run failed before trainer.close() (idempotent)
        write_ray_timeline(trace)


def write_ray_timeline(path: str | None) -> None:
    """verl's ``ray_kwargs.timeline_json_file``: Ray's Chrome trace of the run's tasks and actor
    calls. Written also when the run fails (that is when one wants it); never fails the run.
    Returns None, so ``trace = write_ray_timeline(trace)`` writes it once."""
    if not path:
        return None
    import time

    import ray

    # workers report task events once a second (RAY_task_events_report_interval_ms): without the
    # wait the last step's calls were missing from the trace
    time.sleep(1.5)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        ray.timeline(filename=path)
        print(f"ray timeline: {path}", flush=True)
    except Exception as err:  # a trace is a diagnostic: losing it must not lose the run's result
        print(f"ray timeline not written to {path}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


class Terminated(BaseException):
    """SIGTERM (``scancel``, a Slurm time limit, ``kill``): the run stops as on Ctrl-C.

    A BaseException, as KeyboardInterrupt is: the handler raises it wherever the driver happens to
    be, and code that survives a failing part (``except Exception`` around a user's reward
    function, which scores that sample 0 and goes on) must not survive a stop."""


# What the SIGTERM handler raised, if it ran. Raised inside Ray's own code (deserialising a
# result, say), Terminated reaches the run wrapped in another error (RaySystemError); the stop
# is still the signal's, not a failure.
_sigterm: list[Terminated] = []


def stop_on_sigterm() -> Any:
    """Turn SIGTERM into :class:`Terminated` in the driver, so the run's ``finally`` blocks shut
    the workers down and the user reads what is left to resume from. Installed after
    ``ray.init``, whose own handler exits without saying more; returns the handler it replaced
    (for :func:`restore_sigterm`), or None off the main thread, where Python allows no handler."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    _sigterm.clear()

    def handler(signum, frame):
        _sigterm.append(Terminated(f"stopped by {signal.Signals(signum).name}"))
        raise _sigterm[-1]

    return signal.signal(signal.SIGTERM, handler) or signal.SIG_DFL


def restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def last_checkpoint_line(cfg) -> str:
    """What a stopped run leaves to resume from, and how, as the last line the user reads: the
    checkpoint the tracker names if it verifies (manifest, sizes, hashes), else the newest one that
    does, never one that a resume would refuse."""
    from hybridflow.trainer.checkpoint import CheckpointError, check_complete, newest_verified, read_tracker, step_dir

    root = cfg.trainer.default_local_dir
    try:
        step = read_tracker(root)
    except CheckpointError as err:
        return f"the run stopped; {err}"
    tracked = step_dir(root, step) if step is not None else None
    good = None
    if tracked is not None:
        try:
            check_complete(tracked)
            good = tracked
        except CheckpointError:
            pass
    good = good or newest_verified(root, skip=step)
    if good is None:
        return (f"the run stopped before its first checkpoint (trainer.save_freq={cfg.trainer.save_freq}); "
                f"nothing to resume from in {root}")
    if tracked is not None and good != tracked:  # auto would pick the damaged tracked one
        return (f"the run stopped; its last checkpoint {tracked} does not verify, the newest that does is {good}: "
                f"run again with trainer.resume_mode={good} to resume from it")
    how = ("run the same command again to resume from it" if cfg.trainer.resume_mode == "auto" else
           "run again with trainer.resume_mode=auto to resume from it")
    return f"the run stopped; its last complete checkpoint is {good}: {how}"


def memory_hint(cfg) -> str:
    """The keys that lower a worker's host memory, for the stop line of a run that ran out of it."""
    if not hasattr(cfg, "actor_rollout_ref"):  # the SFT recipe
        return ("a smaller data.micro_batch_size_per_gpu, model.enable_gradient_checkpointing=true, "
                "or more workers (trainer.n_gpus_per_node)")
    arr = "actor_rollout_ref"
    return (f"{arr}.rollout.tensor_model_parallel_size=2 or more (splits vLLM's copy of the weights), a smaller "
            f"{arr}.rollout.kv_cache_gib, {arr}.rollout.cpu_live_weights=false, a smaller "
            f"{arr}.actor.ppo_micro_batch_size_per_gpu, or {arr}.model.enable_gradient_checkpointing=true "
            "(docs/placement.md: Host memory on CPU)")


def report_stop(cfg, err: BaseException) -> int:
    """Print why a started run stopped (one line for a broken reward function or a worker killed
    for lack of memory, the traceback of a dead or failing worker), then what it left to resume
    from; return the exit code."""
    if _sigterm and not isinstance(err, KeyboardInterrupt):
        err = _sigterm[-1]
    if isinstance(err, RewardFunctionError):  # raised on every sample of a batch: the run stopped cleanly
        print(f"reward function error: {err}", file=sys.stderr)
    elif isinstance(err, WorkerMemoryError):  # not a bug in the code: the traceback would only distract
        print(f"out of memory: {err}. To lower the memory per worker: {memory_hint(cfg)}", file=sys.stderr)
    elif isinstance(err, KeyboardInterrupt):
        print("interrupted (Ctrl-C)", file=sys.stderr)
    elif isinstance(err, Terminated):
        print(err, file=sys.stderr)
    elif isinstance(err, (NonFiniteError, CheckpointSaveError)):  # the run's numbers or disk, not a bug
        print(f"{'training stopped' if isinstance(err, NonFiniteError) else 'checkpoint error'}: {err}",
              file=sys.stderr)
    else:
        traceback.print_exception(err)
        for line in after_failure(cfg.trainer.default_local_dir, getattr(err, "died", None)):
            print(line, file=sys.stderr)
    print(last_checkpoint_line(cfg), file=sys.stderr)
    # the shell's convention: 128 + the signal number
    return 130 if isinstance(err, KeyboardInterrupt) else 143 if isinstance(err, Terminated) else 1


def logs_clause(summary: dict) -> str:
    """The end of the final line: where vLLM's, Ray's and the workers' lines went, if not here."""
    return f"; full logs in {summary['logs']}" if summary.get("logs") else ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        info = cli_info(argv, "ppo", __doc__)
        if info is not None:
            print(info)
            return 0
        cfg = load_and_validate(argv)
        inputs = read_inputs(cfg)
    except tuple(INPUT_ERRORS) as err:
        print(input_error_line(err), file=sys.stderr)
        return 2
    try:
        summary = run(cfg, inputs)
    except (Exception, KeyboardInterrupt, Terminated) as err:  # a broken reward function, a dead worker,
        return report_stop(cfg, err)  # Ctrl-C, SIGTERM
    if cfg.trainer.val_only:
        scores = {k: round(v, 4) for k, v in summary["history"][-1].items() if k.startswith("val/")}
        print(f"done: validation only, at step {summary['steps']}: {scores}" + logs_clause(summary))
    else:
        print(f"done: {summary['steps']} steps; HF checkpoint in {summary['hf_dir']}; reward curve {summary['plot']}"
              + logs_clause(summary))
    return 0


if __name__ == "__main__":
    from recipes.process_exit import exit_process

    exit_process(main())
