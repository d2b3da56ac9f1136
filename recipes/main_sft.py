"""SFT entry point: ``python -m recipes.main_sft key=value ...``; --help lists the keys (hybridflow/config/sft.py)."""
from __future__ import annotations

import os
import sys

from hybridflow.config import ConfigError
from hybridflow.model_files import weights_error
from hybridflow.config.sft import SFTConfig, load_sft_config, validate_sft
from hybridflow.data.dataset import DataError
from hybridflow.trainer.checkpoint import CheckpointError, open_resume
from hybridflow.trainer.sft_trainer import sft_worker_layout
from recipes.cli import cli_info, compose_config, split_cli_args
from recipes.engine_settings import sft_engine_kwargs
from recipes.main_ppo import (Terminated, available_slots, input_error_line, logs_clause, ray_address_from_env,
                              report_stop, restore_sigterm, stop_on_sigterm)


def load_and_validate(argv):
    name, overrides = split_cli_args(argv, "sft")
    cfg = ray_address_from_env(load_sft_config(compose_config(name, overrides, schema=SFTConfig)))
    validate_sft(cfg, available_slots=available_slots(cfg))
    # not part of validate_sft, which checks layouts against config.json alone (as its tests do):
    # a folder without weight files failed a minute later inside a worker
    weightless = weights_error("model.path", cfg.model.path)
    if weightless:
        raise ConfigError(weightless)
    # the checkpoint to resume from is complete and saved with this layout, before Ray starts
    open_resume(cfg.trainer.default_local_dir, cfg.trainer.resume_mode, sft_worker_layout(cfg))
    return cfg


def run(cfg) -> dict:
    """Read and check the data, then train on Ray; returns a summary dict whose ``logs`` is the
    run's log folder (None when HYBRIDFLOW_VERBOSE keeps every line on the console)."""
    from hybridflow.data.loader import ResumablePromptLoader
    from hybridflow.data.sft_dataset import SFTDataset, collate_sft
    from hybridflow.model_files import load_model_tokenizer
    from hybridflow.run_logs import quiet_driver
    from workers.engines.config import EngineConfig

    d, t = cfg.data, cfg.trainer
    tokenizer = load_model_tokenizer("model", cfg.model)
    kw = dict(prompt_key=d.prompt_key, response_key=d.response_key, max_length=d.max_length,
              apply_chat_template=d.apply_chat_template, truncation=d.truncation,
              messages_key=d.multiturn.messages_key if d.multiturn.enable else None,
              prompt_dict_keys=d.prompt_dict_keys, response_dict_keys=d.response_dict_keys)
    train_ds = SFTDataset(d.train_files, tokenizer, **kw)
    val_ds = SFTDataset(d.val_files, tokenizer, **kw) if d.val_files else None
    train_loader = ResumablePromptLoader(train_ds, d.train_batch_size, shuffle=d.shuffle, seed=d.seed,
                                         collate_fn=collate_sft)
    val_loader = (ResumablePromptLoader(val_ds, min(len(val_ds), 256), shuffle=False, drop_last=False,
                                        collate_fn=collate_sft) if val_ds else None)
    steps = len(train_loader) * t.total_epochs
    steps = min(steps, t.total_training_steps) if t.total_training_steps else steps
    engine = EngineConfig(**sft_engine_kwargs(cfg, steps))
    # the data is read and checked first: a bad input leaves no log folder behind
    with quiet_driver(t.default_local_dir) as logs:
        return {**_train(cfg, engine, train_loader, val_loader), "logs": logs}


def _train(cfg, engine, train_loader, val_loader) -> dict:
    """Start Ray and the SFT workers, train, export the HF checkpoint."""
    import dataclasses

    from hybridflow import device
    from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
    from hybridflow.tracking import Tracker, flatten_config, with_jsonl
    from hybridflow.trainer.sft_trainer import SFTTrainer
    from recipes.ray_start import start_ray
    from recipes.worker_env import ray_runtime_env
    from workers.sft_worker import SFTSettings, SFTWorker

    t = cfg.trainer
    use_gpu = device.uses_gpu(t.device)
    start_ray(cfg.ray_init, ray_runtime_env(cfg, cfg.model.path))
    previous_sigterm = stop_on_sigterm()
    pool = ResourcePool([t.n_gpus_per_node] * t.nnodes, use_gpu=use_gpu, cpus_per_slot=t.cpus_per_worker)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SFTWorker, SFTSettings(cfg.model.path, engine)),
                           name_prefix="sft", timeout_s=t.call_timeout_s,
                           init_timeout_s=t.init_timeout_s)
    tracker = Tracker(with_jsonl(t.logger), t.project_name, t.experiment_name, t.default_local_dir,
                      flatten_config(dataclasses.asdict(cfg)))
    try:
        group.init_model()
        trainer = SFTTrainer(cfg, group, train_loader, val_loader, tracker,
                             progress=sys.stderr.isatty() or bool(os.environ.get("HYBRIDFLOW_PROGRESS")))
        history = trainer.fit()
        group.save_hf(t.hf_output_dir)
    finally:
        tracker.finish()
        group.shutdown()
        pool.release()
        restore_sigterm(previous_sigterm)
    return {"history": history, "hf_dir": t.hf_output_dir, "steps": trainer.global_step}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        info = cli_info(argv, "sft", __doc__, schema=SFTConfig)
        if info is not None:
            print(info)
            return 0
        cfg = load_and_validate(argv)
    except (ConfigError, CheckpointError) as err:
        print(input_error_line(err), file=sys.stderr)
        return 2
    try:
        summary = run(cfg)  # loads the tokenizer and checks every data row before Ray starts
    except (DataError, ConfigError) as err:
        print(input_error_line(err), file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt, Terminated) as err:  # a dead or failing worker, Ctrl-C, SIGTERM
        return report_stop(cfg, err)
    print(f"done: {summary['steps']} SFT steps; HF checkpoint in {summary['hf_dir']}" + logs_clause(summary))
    return 0


if __name__ == "__main__":
    from recipes.process_exit import exit_process

    exit_process(main())
