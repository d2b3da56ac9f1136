"""``trainer`` (the loop, outputs, resources), ``ray_init`` and ``ray_kwargs``."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import FREQ, GREATER_THAN_0, NON_NEGATIVE, OPTIONAL_POSITIVE, POSITIVE, Registry, key

RUN_DIR = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"


@dataclass
class TrainerConfig:
    device: str = key("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    nnodes: int = key(1, "nodes", POSITIVE)
    n_gpus_per_node: int | str = key(1, "GPUs per node; on CPU: worker slots per node | auto: this node's GPUs; "
                                        "on CPU, replicated workers of cpus_per_worker cores or one worker with "
                                        "every core, whichever the placement cost model predicts faster",
                                     POSITIVE)
    total_epochs: int = key(1, "passes over the training prompts", POSITIVE)
    total_training_steps: int | None = key(None, "null: epochs x batches per epoch", OPTIONAL_POSITIVE)
    save_freq: int = key(-1, "steps between checkpoints; -1: none during training", FREQ)
    test_freq: int = key(-1, "steps between validations; -1: none during training", FREQ)
    val_before_train: bool = key(True, "validate before the first step")
    balance_batch: bool = key(True, "even the tokens per data-parallel rank (a prompt's samples stay together)")
    val_only: bool = key(False, "validate the model (or the checkpoint resumed) and stop")
    log_val_generations: int = key(0, "samples of each validation written to val_generations.jsonl", NON_NEGATIVE)
    critic_warmup: int = key(0, "the actor's first update is at step critic_warmup (verl's count: k-1 critic-only "
                                "steps; 0 and 1 both train the actor from step 1)", NON_NEGATIVE)
    default_local_dir: str = key("checkpoints/hybridflow/demo", "the run's folder: checkpoints, logs, metrics",
                                 path=True, composed=RUN_DIR)
    default_hdfs_dir: str | None = key(None, "only null: no HDFS upload")
    resume_mode: str = key("auto", "auto | disable | a global_step_N directory | resume_path")
    resume_from_path: str | None = key(None, "with resume_mode=resume_path (verl's form): the global_step_N "
                                             "directory", path=True)
    max_actor_ckpt_to_keep: int | None = key(None, "null: keep all", OPTIONAL_POSITIVE)
    max_critic_ckpt_to_keep: int | None = key(None, "null: keep all (one folder holds actor and critic: the "
                                                    "smaller limit wins)", OPTIONAL_POSITIVE)
    rollout_data_dir: str | None = key(None, "a folder: each step's prompts, responses and scores as <step>.jsonl",
                                       path=True)
    validation_data_dir: str | None = key(None, "a folder: each validation's samples as <step>.jsonl", path=True)
    logger: list[str] = key(["console", "jsonl"], "console | jsonl | tensorboard | mlflow | wandb "
                                                  "(metrics.jsonl is always written)",
                             choices=Registry("BACKENDS", "hybridflow.tracking.tracker"))
    project_name: str = key("hybridflow", "the tracking project")
    experiment_name: str = key("demo", "the tracking run's name")
    call_timeout_s: float = key(600.0, "every worker call and collective of a step", GREATER_THAN_0)
    init_timeout_s: float = key(1800.0, "the workers' start-up (init_model: models, weights, vLLM)", GREATER_THAN_0)
    placement: str = key("colocate", "colocate | separate (critic/ref/reward model on a 2nd pool of nnodes x "
                                     "separate_pool_gpus_per_node slots) | auto (the planner picks placement, "
                                     "slots and layouts by predicted step time: docs/placement.md)",
                         choices=("colocate", "separate", "auto"))
    separate_pool_gpus_per_node: int = key(1, "placement=separate: the 2nd pool's slots per node", POSITIVE)
    overlap_separate_pools: bool = key(True, "separate: the 2nd pool's calls run while the actor's pool works")
    cpus_per_worker: float = key(1.0, "Ray CPU resources per worker process", GREATER_THAN_0)
    seed: int = key(0, "seeds every rank")
    timeline: bool = key(False, "record each worker's stages: timeline.json (Chrome trace), timeline.png, idle_frac")


@dataclass
class RayInitConfig:
    address: str | None = key(None, "null: a local Ray; auto: join a running cluster")
    num_cpus: int | None = key(None, "local Ray only; null: the machine's cores", OPTIONAL_POSITIVE)


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = key(RayInitConfig(), "verl's newer home of ray_init; a value set here fills ray_init's")
    timeline_json_file: str | None = key(None, "a Chrome trace of every Ray task and actor call, written when "
                                               "the run ends", path=True)
