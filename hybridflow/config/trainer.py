"""``trainer`` (the loop, outputs, resources) and ``ray_init``.

On CPU ``n_gpus_per_node`` counts worker slots (one process each). With ``placement=separate``
the actor+rollout pool keeps ``nnodes * n_gpus_per_node`` slots and the critic, reference and
reward model share a second pool of ``nnodes * separate_pool_gpus_per_node`` slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.common import PATH


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 1
    total_epochs: int = 1
    total_training_steps: int | None = None  # None: epochs x batches per epoch
    save_freq: int = -1  # -1: no checkpoints during training
    test_freq: int = -1  # -1: no validation during training
    val_before_train: bool = True
    # order each step's rows so the data-parallel ranks get similar token counts, a prompt's
    # samples kept together (hybridflow/trainer/balance.py)
    balance_batch: bool = True
    val_only: bool = False  # validate the model (or the checkpoint resumed) and stop, no training
    log_val_generations: int = 0  # validation samples written as text per validation (val_generations.jsonl)
    critic_warmup: int = 0  # steps that update only the critic before the actor starts (PPO with GAE)
    default_local_dir: str = field(default="checkpoints/hybridflow/demo", metadata=PATH)
    default_hdfs_dir: str | None = None  # verl's key; only null (no HDFS upload)
    resume_mode: str = "auto"  # auto | disable | a checkpoint directory path | resume_path (verl's)
    resume_from_path: str | None = field(default=None, metadata=PATH)  # with resume_mode=resume_path
    max_actor_ckpt_to_keep: int | None = None  # None: keep all
    # verl keeps actor and critic checkpoints apart; here one global_step_N folder holds both, so
    # the smaller of the two limits applies to the folders
    max_critic_ckpt_to_keep: int | None = None
    # folders for verl's generation dumps: one <step>.jsonl per training step / per validation
    rollout_data_dir: str | None = field(default=None, metadata=PATH)
    validation_data_dir: str | None = field(default=None, metadata=PATH)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "hybridflow"
    experiment_name: str = "demo"
    call_timeout_s: float = 600.0  # every remote call and collective
    # start-up (init_model: build the models, load weights, start vLLM), slow on a loaded machine
    # without being stuck; collectives inside it are bounded by the larger of the two
    init_timeout_s: float = 1800.0
    placement: str = "colocate"  # colocate | separate
    separate_pool_gpus_per_node: int = 1
    # placement=separate: the second pool's calls (reward model, reference, values, critic update)
    # run while the actor's pool works; false runs one stage after the other (to time each alone)
    overlap_separate_pools: bool = True
    cpus_per_worker: float = 1.0  # Ray CPU resources per worker process
    seed: int = 0


@dataclass
class RayInitConfig:
    address: str | None = None  # None: start a local Ray; "auto": join a running cluster
    num_cpus: int | None = None  # local Ray only; None: Ray's default (the machine's cores)


@dataclass
class RayKwargsConfig:
    """verl's newer home of ``ray_init`` (``ray_kwargs.ray_init.num_cpus=...``). ``load_config``
    folds a value set here into ``ray_init``, which the rest of the code reads."""

    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    # a Chrome trace (chrome://tracing, Perfetto) of every Ray task and actor call of the run,
    # written when it ends (ray.timeline)
    timeline_json_file: str | None = field(default=None, metadata=PATH)
