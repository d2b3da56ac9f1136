"""Every check a run needs before any worker (or Ray) starts; one line per problem, all at once.
Order matters: value ranges and names first (the arithmetic below divides by them), then parallel
sizes and batch divisibility (verl's rules), then the model's shapes, files on disk and devices."""
from __future__ import annotations

import logging
import os

from hybridflow.config.derived import (
    critic_external_lib, critic_shares_actor_model, derive, estimator_needs_critic, log_prob_token_budget,
    model_parallel, needs_critic, needs_reference, reward_fn_runs_async, reward_model_external_lib, reward_pool_world,
    rollout_pool_world,
)
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import ARR
from hybridflow.config.load import RESUME_MODES
from hybridflow.config.ranges import name_errors as declared_name_errors, range_errors
from hybridflow.config.resolve import strictly_on_policy
from hybridflow.config.root import RootConfig
from hybridflow.config.multi_turn import multi_turn_errors
from hybridflow.config.speculative import speculative_errors
from hybridflow.config.placement_auto import placement_auto_errors
from hybridflow.config.rules import (
    checkpoint_errors, fsdp_size_error, lora_strategy_errors, overlong_buffer_errors, rollout_correction_errors,
    bypass_errors, rollout_correction_on, rollout_errors, rollout_pool_errors, stage_fusion_errors,
    reallocation_errors,
)
from hybridflow.host_checks import data_file_errors, device_errors, output_folder_errors, path_error
from hybridflow.model_checks import ModelRoles, model_config_errors, model_file_errors, model_folders, read_model_config
from hybridflow.model_overrides import external_lib_error
from hybridflow.verl_compat import convert_global_micro_batch_sizes, unsupported_errors

logger = logging.getLogger(__name__)


def validate(cfg: RootConfig, *, available_slots: int | None = None,
             model_config: dict | None = None, check_paths: bool = True) -> None:
    """Raise :class:`ConfigError` (one line, every problem found) if ``cfg`` cannot run; log a warning
    for each legal but odd setting. ``available_slots``: worker slots the cluster offers (None: not
    checked). ``model_config``: the actor's ``config.json`` (None: read from its model.path).
    ``check_paths=False`` skips the file checks (a dry run before the demo data is built)."""
    # first: the actor's external_lib may register names checked below (an advantage estimator, a
    # policy loss) as well as its model_type
    lib_error = external_lib_error(f"{ARR}.model.external_lib", cfg.actor_rollout_ref.model.external_lib)
    errors = ([lib_error] if lib_error else []) + range_errors(cfg) + name_errors(cfg)
    if errors:  # the checks below divide by these values
        raise ConfigError("; ".join(errors))
    parallel = parallel_errors(cfg)
    errors = (algorithm_errors(cfg) + rollout_correction_errors(cfg) + rollout_errors(cfg) + rollout_pool_errors(cfg)
              + bypass_errors(cfg)
              + stage_fusion_errors(cfg, model_roles(cfg)) + reallocation_errors(cfg) + speculative_errors(cfg)
              + multi_turn_errors(cfg)
              + overlong_buffer_errors(cfg) + placement_auto_errors(cfg)
              + unsupported_errors(cfg)
              + lora_errors(cfg) + checkpoint_errors(cfg) + parallel)
    if not parallel:  # the batch rules divide by the data-parallel sizes
        d = derive(cfg)
        reward_dp = reward_pool_world(cfg) or (d.aux_world if cfg.trainer.placement == "separate" else d.actor_world)
        errors += convert_global_micro_batch_sizes(cfg, d.actor_dp, d.critic_dp, reward_dp) + batch_errors(cfg)
    # imported before the models' configs are read: a module may register its model_type (the workers
    # import it again)
    libs = [("critic.model.external_lib", critic_external_lib(cfg))] if needs_critic(cfg) else []
    if cfg.reward_model.enable:
        libs.append(("reward_model.model.external_lib", reward_model_external_lib(cfg)))
    errors += [e for e in (external_lib_error(key, name) for key, name in libs) if e]
    if check_paths:
        files = model_file_errors(cfg, needs_critic(cfg))  # a corrupt config.json is named there, not read below
        errors += path_errors(cfg) + files
        if model_config is None and not files:
            model_config = read_model_config(cfg.actor_rollout_ref.model.path)
    if model_config is not None:
        errors += model_config_errors(cfg, model_roles(cfg), model_config)
    t = cfg.trainer
    pools = [("trainer.nnodes*trainer.separate_pool_gpus_per_node",
              t.nnodes * t.separate_pool_gpus_per_node if t.placement == "separate" else 0),
             ("reward_model.nnodes*reward_model.n_gpus_per_node", reward_pool_world(cfg)),
             ("rollout.nnodes*rollout.n_gpus_per_node", rollout_pool_world(cfg))]
    errors += device_errors(t, cfg.ray_init.address, available_slots, pools)
    if errors:
        raise ConfigError("; ".join(errors))
    _warn_odd_settings(cfg)


def model_roles(cfg: RootConfig) -> ModelRoles:
    arr, c = cfg.actor_rollout_ref.actor, cfg.critic
    return ModelRoles(needs_critic(cfg), critic_shares_actor_model(cfg), model_parallel(arr.strategy, arr.megatron),
                      model_parallel(c.strategy, c.megatron))


def lora_errors(cfg: RootConfig) -> list[str]:
    a, c = cfg.actor_rollout_ref, cfg.critic
    return (lora_strategy_errors(f"{ARR}.model", a.model.lora_rank, f"{ARR}.actor.strategy", a.actor.strategy)
            + lora_strategy_errors("critic.model", c.model.lora_rank, "critic.strategy", c.strategy))


def logger_errors(loggers: list[str]) -> list[str]:
    """trainer.logger of either recipe: each logger's package imports, none listed twice."""
    # imported here: the loggers' modules stay out of ``import hybridflow.config``
    from hybridflow.tracking.tracker import backend_import_errors

    errors = backend_import_errors(loggers)
    if len(set(loggers)) != len(loggers):
        errors.append(f"trainer.logger={loggers} lists a logger twice: list each once")
    return errors


def name_errors(cfg: RootConfig) -> list[str]:
    """Names outside their fields' choices (the registries that implement them), and the logger list."""
    a = cfg.actor_rollout_ref.actor
    errors = declared_name_errors(cfg) + logger_errors(cfg.trainer.logger)
    ref_strategy = cfg.actor_rollout_ref.ref.strategy
    if ref_strategy is not None and ref_strategy != a.strategy:
        errors.append(f"{ARR}.ref.strategy={ref_strategy} differs from {ARR}.actor.strategy={a.strategy}: the "
                      "reference runs on the actor's engine; set it to null or the actor's")
    return errors


def algorithm_errors(cfg: RootConfig) -> list[str]:
    """Keys that each make sense alone but not together (estimator, rewards, sampling, batches, pools)."""
    from hybridflow.algorithms import get_advantage_estimator

    alg, r, rm, t, data = cfg.algorithm, cfg.actor_rollout_ref.rollout, cfg.reward_model, cfg.trainer, cfg.data
    est, val = get_advantage_estimator(alg.adv_estimator), r.val_kwargs
    gen, train = data.gen_batch_size, data.train_batch_size
    return [message for wrong, message in [
        (est.needs_critic and cfg.critic.enable is False, f"algorithm.adv_estimator={alg.adv_estimator} needs a "
         "critic's values: set critic.enable=true (or null: on when the estimator needs it)"),
        (est.needs_groups and r.n < 2, f"algorithm.adv_estimator={alg.adv_estimator} compares several responses per "
         f"prompt: set {ARR}.rollout.n>=2 (it is {r.n})"),
        (est.needs_groups and r.temperature == 0, f"algorithm.adv_estimator={alg.adv_estimator} with {ARR}.rollout."
         "temperature=0 samples identical responses (all advantages 0): use a temperature > 0"),
        (rm.reward_manager == "batch" and not cfg.custom_reward_function.path, "reward_model.reward_manager=batch "
         "calls custom_reward_function with whole lists: set custom_reward_function.path (the built-in scorers score "
         "one response at a time)"),
        (rm.enable_resource_pool and not rm.enable, "reward_model.enable_resource_pool=true reserves a pool for a "
         "reward model, but reward_model.enable=false: set reward_model.enable=true, or enable_resource_pool=false"),
        (rm.enable and not rm.model.path, "reward_model.enable=true needs reward_model.model.path (an HF "
         "sequence-classification checkpoint)"),
        (not val.do_sample and val.n > 1, f"{ARR}.rollout.val_kwargs.n={val.n} with do_sample=false repeats one "
         "greedy response: set val_kwargs.n=1 or val_kwargs.do_sample=true"),
        (val.do_sample and val.n > 1 and val.temperature == 0, f"{ARR}.rollout.val_kwargs.n={val.n} with "
         "temperature=0 samples one greedy response n times (vLLM refuses it): set val_kwargs.temperature > 0, "
         "e.g. 1.0"),
        (gen is not None and gen != train and not alg.filter_groups.enable, f"data.gen_batch_size={gen} differs from "
         f"data.train_batch_size={train}, which only algorithm.filter_groups.enable=true uses (it keeps "
         "train_batch_size prompts): set it to null"),
        (gen is not None and gen < train and alg.filter_groups.enable,
         f"data.gen_batch_size={gen} must be >= data.train_batch_size={train}"),
        (alg.filter_groups.enable and r.n < 2, "algorithm.filter_groups.enable=true compares the samples of a prompt: "
         f"set {ARR}.rollout.n>=2 (it is {r.n})"),
        (t.val_only and not data.val_files, "trainer.val_only=true needs data.val_files to validate on"),
        (cfg.actor_rollout_ref.actor.recompute_old_log_prob == "skip" and not strictly_on_policy(cfg)
         and not rollout_correction_on(alg.rollout_correction),  # rollout_correction_errors says why
         f"{ARR}.actor.recompute_old_log_prob=skip needs a strictly on-policy update (ppo_epochs=1, "
         "ppo_mini_batch_size=data.train_batch_size, algorithm.use_kl_in_reward=false): use auto or always"),
        (t.critic_warmup > 1 and not needs_critic(cfg),  # 1: the actor trains from step 1
         f"trainer.critic_warmup={t.critic_warmup} warms up a critic, but algorithm.adv_estimator={alg.adv_estimator} "
         "runs none: set it to 0 or use gae"),
        (t.placement == "separate" and not (needs_critic(cfg) or needs_reference(cfg) or rm.enable),
         "trainer.placement=separate but no critic, reference or reward model runs on the second pool: use "
         "trainer.placement=colocate"),
    ] if wrong]


def sizes_error(key: str, world: int, what: str, size: int) -> str | None:
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        return (f"{key}: {world} workers cannot be split into {what}={size} groups evenly: "
                f"use a {what} in {divisors} or change trainer.nnodes/trainer.n_gpus_per_node")
    return None


def parallel_errors(cfg: RootConfig) -> list[str]:
    """world = tp * pp * dp for every role; rollout tp divides world (and actor tp for Megatron:
    the 3D-HybridEngine regroups each training TP group into micro-DP generation groups)."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    errors = [e for e in (unused_megatron_error(f"{ARR}.actor", arr.actor), unused_megatron_error("critic", cfg.critic))
              if e]
    if errors:
        return errors
    tp, pp = model_parallel(arr.actor.strategy, arr.actor.megatron)
    errors.append(sizes_error(f"{ARR}.actor.megatron (tensor x pipeline parallel)", world, "tp*pp", tp * pp))
    rtp = arr.rollout.tensor_model_parallel_size
    if arr.hybrid_engine:  # else the rollout's own pool: rules.rollout_pool_errors
        errors.append(sizes_error(f"{ARR}.rollout.tensor_model_parallel_size", world, "tp", rtp))
    if arr.hybrid_engine and arr.actor.strategy == "megatron" and tp % rtp:
        errors.append(f"{ARR}.rollout.tensor_model_parallel_size={rtp} must divide "
                      f"{ARR}.actor.megatron.tensor_model_parallel_size={tp} (the hybrid engine "
                      f"reshards each training TP group): use one of "
                      f"{[d for d in range(1, tp + 1) if tp % d == 0]}")
    if arr.rollout.name == "hf" and arr.actor.strategy != "fsdp":
        errors.append(f"{ARR}.rollout.name=hf generates with the actor's own HF module, which "
                      f"{ARR}.actor.strategy={arr.actor.strategy} does not have: use rollout.name=vllm, or "
                      "actor.strategy=fsdp")
    if arr.rollout.name == "hf" and rtp != 1:
        errors.append(f"{ARR}.rollout.name=hf runs one full model per worker: set "
                      f"{ARR}.rollout.tensor_model_parallel_size=1 or use name=vllm")
    side_world = t.nnodes * t.separate_pool_gpus_per_node if t.placement == "separate" else world
    if needs_critic(cfg):
        ctp, cpp = model_parallel(cfg.critic.strategy, cfg.critic.megatron)
        errors.append(sizes_error("critic.megatron (tensor x pipeline parallel)", side_world, "tp*pp", ctp * cpp))
        # megatron-core's parallel_state is per process, and colocated roles share a process.
        if (t.placement == "colocate" and arr.actor.strategy == cfg.critic.strategy == "megatron"
                and (ctp, cpp) != (tp, pp)):
            errors.append(f"critic.megatron (tp={ctp}, pp={cpp}) differs from {ARR}.actor.megatron "
                          f"(tp={tp}, pp={pp}), but trainer.placement=colocate runs both in one process, "
                          "which holds one Megatron layout: use the same sizes, or trainer.placement=separate")
    for prefix, strategy, fsdp, size, trained in (  # a frozen reference has no gradients to offload
            (f"{ARR}.actor", arr.actor.strategy, arr.actor.fsdp_config, world, True),
            (f"{ARR}.ref", arr.actor.strategy, arr.ref.fsdp_config, side_world, False),
            ("critic.model", cfg.critic.strategy, cfg.critic.model.fsdp_config, side_world, needs_critic(cfg))):
        errors += [fsdp_size_error(prefix, strategy, fsdp.fsdp_size, size),
                   trained and replicated_offload_error(prefix, strategy, fsdp, size)]
    return [e for e in errors if e]


def unused_megatron_error(key: str, role) -> str | None:
    """Megatron sizes on a role of another strategy, of either recipe (``key``: the role's section)."""
    if role.strategy != "megatron" and (role.megatron.tensor_model_parallel_size,
                                        role.megatron.pipeline_model_parallel_size) != (1, 1):
        return (f"{key}.megatron.* sizes only apply to {key}.strategy=megatron (it is {role.strategy}, "
                f"data-parallel only): set {key}.strategy=megatron or both sizes to 1")
    return None


def replicated_offload_error(prefix: str, strategy: str, fsdp_config, world: int) -> str | None:
    """A trained FSDP role with fsdp_size=1 on several workers is DDP, whose gradient buckets stay on
    the device: its parameters cannot rest in host memory (the engine refuses; say it before Ray)."""
    if strategy == "fsdp" and fsdp_config.fsdp_size == 1 and world > 1 and fsdp_config.param_offload:
        return (f"{prefix}.fsdp_config.param_offload=true needs sharded parameters, but fsdp_size=1 makes "
                f"each of the {world} workers hold the whole model (DDP): set {prefix}.fsdp_config.fsdp_size=-1 "
                f"or param_offload=false")
    return None


def _minibatch_errors(prefix: str, mini: int, mini_key: str, micro: int, micro_key: str,
                      train: int, n: int, dp: int) -> list[str]:
    if train % mini:
        return [f"data.train_batch_size={train} must be a multiple of {mini_key}={mini} (both count "
                f"prompts): use a mini-batch size in "
                f"{[d for d in range(1, train + 1) if train % d == 0]}"]
    seqs = mini * n
    if seqs % dp:
        return [f"{mini_key}={mini} x {ARR}.rollout.n={n} = {seqs} sequences per mini-batch must "
                f"split evenly over the {dp} {prefix} data-parallel ranks: make {mini_key}*n a "
                f"multiple of {dp}"]
    per_rank = seqs // dp
    # a micro-batch larger than a rank's share is that share: one micro-batch, same numbers (the
    # loss is aggregated over the whole mini-batch), so the defaults run on more workers unchanged
    if micro < per_rank and per_rank % micro:
        return [f"{micro_key}={micro} must divide the {per_rank} sequences each {prefix} rank gets "
                f"per mini-batch ({mini_key}={mini} x n={n} / dp={dp}): use one of "
                f"{[d for d in range(1, per_rank + 1) if per_rank % d == 0]}"]
    return []


def batch_errors(cfg: RootConfig) -> list[str]:
    """verl's rules: mini-batches tile the step's prompts, each mini-batch's sequences the data-parallel
    ranks, micro-batches each rank's share (a micro-batch size above that share means one)."""
    d, arr, c = derive(cfg), cfg.actor_rollout_ref, cfg.critic
    roles = [("actor", f"{ARR}.actor", arr.actor, arr.actor.ppo_mini_batch_size, "", d.actor_dp)]
    if d.use_critic:
        default = "" if c.ppo_mini_batch_size else f" (= {ARR}.actor.ppo_mini_batch_size)"
        roles.append(("critic", "critic", c, d.critic_mini_batch_size, default, d.critic_dp))
    # with use_dynamic_bsz the token budget cuts micro-batches and the row count is not used
    errors = [e for role, key, sec, mini, default, dp in roles for e in _minibatch_errors(
        role, mini, f"{key}.ppo_mini_batch_size{default}", 1 if sec.use_dynamic_bsz
        else sec.ppo_micro_batch_size_per_gpu, f"{key}.ppo_micro_batch_size_per_gpu", cfg.data.train_batch_size,
        arr.rollout.n, dp)]
    return errors + token_budget_errors(cfg)


def token_budget_errors(cfg: RootConfig) -> list[str]:
    """With use_dynamic_bsz a micro-batch must hold at least one whole sequence (verl's rule)."""
    arr, c, data = cfg.actor_rollout_ref, cfg.critic, cfg.data
    seq = data.max_prompt_length + data.max_response_length
    budgets = [(f"{ARR}.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu,
                arr.actor.use_dynamic_bsz)]
    for key, section in ((f"{ARR}.rollout", arr.rollout), (f"{ARR}.ref", arr.ref)):
        budget = log_prob_token_budget(cfg, section)
        if budget is not None:
            name = ("log_prob_max_token_len_per_gpu" if section.log_prob_max_token_len_per_gpu
                    else "log_prob_max_token_len_per_gpu (= actor.ppo_max_token_len_per_gpu)")
            budgets.append((f"{key}.{name}", budget, True))
    if needs_critic(cfg):
        budgets.append(("critic.ppo_max_token_len_per_gpu", c.ppo_max_token_len_per_gpu, c.use_dynamic_bsz))
        if c.forward_max_token_len_per_gpu:
            budgets.append(("critic.forward_max_token_len_per_gpu", c.forward_max_token_len_per_gpu,
                            c.use_dynamic_bsz))
    return [f"{key}={budget} must hold one whole sequence with use_dynamic_bsz: at least "
            f"data.max_prompt_length + data.max_response_length = {seq}"
            for key, budget, used in budgets if used and budget < seq]


def path_errors(cfg: RootConfig) -> list[str]:
    """Every file and folder the run reads or writes, against the disk."""
    data, t, model = cfg.data, cfg.trainer, cfg.actor_rollout_ref.model
    errors = data_file_errors(data)
    if not data.val_files and (t.test_freq > 0 or t.val_before_train):
        errors.append("data.val_files is empty but validation is on: give val files or set "
                      "trainer.test_freq=-1 and trainer.val_before_train=false")
    errors += [path_error(key, folder, "dir") for key, folder in model_folders(cfg, needs_critic(cfg))]
    if os.path.isdir(model.path) and not os.path.isfile(os.path.join(model.path, "config.json")):
        errors.append(f"{ARR}.model.path: {model.path} has no config.json: point it at an HF checkpoint directory")
    errors.append(path_error("custom_reward_function.path", cfg.custom_reward_function.path, "file"))
    if t.resume_mode not in RESUME_MODES:
        errors.append(path_error("trainer.resume_mode", t.resume_mode, "dir"))
    errors += output_folder_errors(t, ("default_local_dir", "rollout_data_dir", "validation_data_dir"))
    return [e for e in errors if e]


def _warn_odd_settings(cfg: RootConfig) -> None:
    """Legal settings that likely do not do what was meant: one warning each."""
    a, alg, rm = cfg.actor_rollout_ref.actor, cfg.algorithm, cfg.reward_model
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    odd = [
        (a.use_kl_loss and alg.use_kl_in_reward, "both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_"
         "reward are on: the KL to the reference is penalised twice (in the loss and the reward)"),
        (cfg.critic.enable and not estimator_needs_critic(alg.adv_estimator), f"critic.enable=true with "
         f"algorithm.adv_estimator={alg.adv_estimator}: the critic is trained but its values are not used"),
        (rm.enable and cfg.custom_reward_function.path, "custom_reward_function.path is not called: with "
         "reward_model.enable=true the reward model scores every sample, in training and validation"),
        (rm.launch_reward_fn_async and not reward_fn_runs_async(cfg), "reward_model.launch_reward_fn_async=true is "
         "ignored: a reward model, or algorithm.filter_groups, needs the scores before the next stage"),
        (a.policy_loss.loss_mode == "gspo" and max(low, high) > 0.01, f"actor.policy_loss.loss_mode=gspo with "
         f"clip_ratio_low/high {low}/{high}: the GSPO paper uses a clip range near 1e-3 (low 3e-4, high 4e-4), as "
         "--config-name gspo sets"),
    ]
    for key, model, strategy, used in ((f"{ARR}.model", cfg.actor_rollout_ref.model, a.strategy, True),
                                       ("critic.model", cfg.critic.model, cfg.critic.strategy, needs_critic(cfg))):
        odd.append((used and strategy == "fsdp" and model.share_prompt_prefix and model.enable_gradient_checkpointing,
                    f"{key}.enable_gradient_checkpointing=true turns off {key}.share_prompt_prefix in the FSDP update "
                    "(transformers' checkpointing runs without the shared prompt's cache): less memory, more compute"))
    for on, message in odd:
        if on:
            logger.warning(message)
