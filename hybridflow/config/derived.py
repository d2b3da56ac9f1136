"""Numbers the trainer derives from a config: parallel sizes, per-step batch counts (verl's
arithmetic: actor_rollout_ref.py's docstring), run length, and the predicates on which roles a
run builds (the engines' settings are built from these in ``recipes/engine_settings.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

# Names owned by workers/ that the config declares too: test_engine_bridge checks they stay equal
from hybridflow.config.actor_rollout_ref import ROLLOUT_NAMES  # noqa: F401
from hybridflow.config.common import LR_SCHEDULERS, PARAM_DTYPES, STRATEGIES  # noqa: F401
from hybridflow.config.resolve import (  # noqa: F401 (estimator_needs_critic: validate imports it from here)
    estimator_needs_critic, needs_critic, needs_reference, resolve,
)
from hybridflow.config.root import RootConfig

# verl names its FSDP2 engine "fsdp2" and its FSDP1 engine "fsdp"; the FSDP engine here is FSDP2,
# so both spellings select it
STRATEGY_ALIASES = {"fsdp2": "fsdp"}


def canonical_strategy(name):
    """The engine a strategy name selects (``fsdp2`` -> ``fsdp``); other names pass unchanged."""
    return STRATEGY_ALIASES.get(name, name)


def reward_pool_world(cfg: RootConfig) -> int:
    """Workers of the reward model's own pool (``reward_model.enable_resource_pool``), else 0."""
    rm = cfg.reward_model
    return rm.nnodes * rm.n_gpus_per_node if rm.enable and rm.enable_resource_pool else 0


def reward_fn_runs_async(cfg: RootConfig) -> bool:
    """verl's ``reward_model.launch_reward_fn_async``, where it can apply: not with a reward model
    (itself a worker call) nor with dynamic sampling, which needs the scores at once."""
    return (cfg.reward_model.launch_reward_fn_async and not cfg.reward_model.enable
            and not cfg.algorithm.filter_groups.enable)


def critic_shares_actor_model(cfg: RootConfig) -> bool:
    """``critic.model.path`` null (or the actor's path): the critic's backbone is the actor's model."""
    return cfg.critic.model.path in (None, cfg.actor_rollout_ref.model.path)


def critic_external_lib(cfg: RootConfig) -> str | None:
    """``critic.model.external_lib``, or else the actor's, as in verl (a critic's own checkpoint is
    usually of the actor's architecture, which that module registers)."""
    return cfg.critic.model.external_lib or cfg.actor_rollout_ref.model.external_lib


def reward_model_external_lib(cfg: RootConfig) -> str | None:
    """``reward_model.model.external_lib``, or else the actor's, as in verl."""
    return cfg.reward_model.model.external_lib or cfg.actor_rollout_ref.model.external_lib


def rollout_pool_world(cfg: RootConfig) -> int:
    """Workers of the rollout's own pool (``actor_rollout_ref.hybrid_engine=false``), else 0."""
    return 0 if cfg.actor_rollout_ref.hybrid_engine else cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node


def model_parallel(strategy: str, megatron) -> tuple[int, int]:
    """(tp, pp) a role trains with; fsdp shards data-parallel only."""
    if strategy == "megatron":
        return megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    return 1, 1


@dataclass(frozen=True)
class Derived:
    actor_world: int  # workers in the actor/rollout pool (= nnodes * n_gpus_per_node)
    actor_dp: int  # actor_world // (tp * pp)
    rollout_dp: int  # generation engines: (rollout pool's or actor's world) // rollout tp
    critic_world: int  # workers hosting the critic (0 without one)
    critic_dp: int
    aux_world: int  # workers of the separate pool (0 when colocated)
    rollout_world: int  # workers of the rollout's own pool (0 with the hybrid engine)
    total_workers: int  # Ray worker processes the run starts
    use_critic: bool
    use_reference: bool
    sequences_per_step: int  # train_batch_size * rollout.n
    actor_mini_batches_per_epoch: int  # optimizer steps per ppo epoch
    actor_micro_batches_per_mini: int  # gradient-accumulation steps per rank
    actor_optimizer_steps_per_step: int  # ppo_epochs * mini-batches
    critic_mini_batch_size: int  # prompts
    critic_ppo_epochs: int
    critic_optimizer_steps_per_step: int
    steps_per_epoch: int | None  # None when the data set length is unknown
    total_training_steps: int | None
    actor_warmup_steps: int | None
    critic_warmup_steps: int | None


def prompts_per_generation_batch(cfg: RootConfig) -> int:
    """What the training data loader yields at a time: ``data.gen_batch_size`` (dynamic sampling
    generates more than it trains on), else ``data.train_batch_size``."""
    return cfg.data.gen_batch_size or cfg.data.train_batch_size


def warmup_steps(optim, total_optimizer_steps: int | None) -> int | None:
    """An optimizer's warm-up steps: ``lr_warmup_steps``, or else its ``lr_warmup_steps_ratio`` of the total."""
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    if total_optimizer_steps is None:
        return None if optim.lr_warmup_steps_ratio > 0 else 0
    return int(optim.lr_warmup_steps_ratio * total_optimizer_steps)


def derive(cfg: RootConfig, dataset_len: int | None = None) -> Derived:
    """Derived sizes; assumes ``validate(cfg)`` passed (divisions are exact there). ``dataset_len``:
    training prompts after filtering (the loader drops the last partial batch). A config built in code
    rather than by ``load_config`` has its ``auto`` values resolved here (a loaded one has none left).
    """
    resolve(cfg)
    arr, tr = cfg.actor_rollout_ref, cfg.trainer
    n = arr.rollout.n
    world = tr.nnodes * tr.n_gpus_per_node
    tp, pp = model_parallel(arr.actor.strategy, arr.actor.megatron)
    use_critic = needs_critic(cfg)
    separate = tr.placement == "separate"
    aux_world = tr.nnodes * tr.separate_pool_gpus_per_node if separate else 0
    critic_world = (aux_world if separate else world) if use_critic else 0
    ctp, cpp = model_parallel(cfg.critic.strategy, cfg.critic.megatron)
    critic_dp = critic_world // (ctp * cpp) if critic_world else 0

    actor_dp = world // (tp * pp)
    rollout_world = rollout_pool_world(cfg)
    mini_seqs_per_rank = arr.actor.ppo_mini_batch_size * n // actor_dp
    actor_minis = cfg.data.train_batch_size // arr.actor.ppo_mini_batch_size
    actor_opt_steps = arr.actor.ppo_epochs * actor_minis
    critic_mini = cfg.critic.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size
    critic_epochs = cfg.critic.ppo_epochs or arr.actor.ppo_epochs
    critic_opt_steps = critic_epochs * (cfg.data.train_batch_size // critic_mini) if use_critic else 0

    per_epoch = None if dataset_len is None else dataset_len // prompts_per_generation_batch(cfg)
    total = tr.total_training_steps
    if total is None and per_epoch is not None:
        total = per_epoch * tr.total_epochs
    return Derived(
        actor_world=world, actor_dp=actor_dp,
        rollout_dp=(rollout_world or world) // arr.rollout.tensor_model_parallel_size,
        critic_world=critic_world, critic_dp=critic_dp, aux_world=aux_world, rollout_world=rollout_world,
        total_workers=world + aux_world + rollout_world,
        use_critic=use_critic, use_reference=needs_reference(cfg),
        sequences_per_step=cfg.data.train_batch_size * n,
        actor_mini_batches_per_epoch=actor_minis,
        actor_micro_batches_per_mini=max(1, mini_seqs_per_rank // arr.actor.ppo_micro_batch_size_per_gpu),
        actor_optimizer_steps_per_step=actor_opt_steps,
        critic_mini_batch_size=critic_mini, critic_ppo_epochs=critic_epochs,
        critic_optimizer_steps_per_step=critic_opt_steps,
        steps_per_epoch=per_epoch, total_training_steps=total,
        actor_warmup_steps=warmup_steps(arr.actor.optim, None if total is None else total * actor_opt_steps),
        critic_warmup_steps=warmup_steps(cfg.critic.optim, None if total is None else total * critic_opt_steps),
    )


def log_prob_token_budget(cfg: RootConfig, section) -> int | None:
    """The token budget of a log-prob pass (``rollout`` or ``ref`` section, verl's
    ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu``; null follows the actor's
    ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``), or None for fixed-size micro-batches."""
    actor = cfg.actor_rollout_ref.actor
    use = actor.use_dynamic_bsz if section.log_prob_use_dynamic_bsz is None else section.log_prob_use_dynamic_bsz
    if not use:
        return None
    return section.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu


def lora_kwargs(model) -> dict:
    """verl's LoRA keys of a model section (``common.LoraKeys``) as EngineConfig arguments."""
    return dict(lora_rank=model.lora_rank, lora_alpha=model.lora_alpha, target_modules=list(model.target_modules),
                exclude_modules=list(model.exclude_modules) or None)
