"""The PPO-family dataflow on the single controller. Read ``step`` top to bottom:

    generate -> reward -> old log-prob -> ref log-prob -> values -> advantages -> critic update
    -> actor update -> (the next generate syncs weights) -> validate / checkpoint / log

GRPO, ReMax, RLOO and REINFORCE++ are settings of this loop (``algorithm.adv_estimator``), not
copies of it. Each heavy node is one call on a worker group; the controller only moves DataProto
batches and computes advantages (cheap, on CPU).
"""
from __future__ import annotations

import os
import uuid

import numpy as np
import torch

from hybridflow.algorithms import (
    apply_kl_penalty, combine_metric, compute_advantage, get_advantage_estimator, make_kl_controller,
)
from hybridflow.config.derived import model_parallel, reward_fn_runs_async
from hybridflow.config.resolve import bypass_old_log_prob
from hybridflow.config.rules import rollout_correction_on
from hybridflow.data.loader import TENSOR_KEYS
from hybridflow.protocol import DataProto
from hybridflow.trainer import checkpoint as ckpt, pool_calls
from hybridflow.trainer.checkpoint import worker_layout  # noqa: F401 (its home before checkpoint.py)
from hybridflow.trainer.async_rollout import AheadLoader, generation_request, greedy_request, staleness_metrics
from hybridflow.trainer.balance import balanced_order
from hybridflow.trainer.finite import stop_if_non_finite
from hybridflow.trainer.fused_rollout import fused_rollout_for
from hybridflow.trainer.reallocated_rollout import AnswerLengths, generate
from hybridflow.algorithms.dynamic_sampling import DynamicSamplingError, informative_rows, metric_values
from hybridflow.trainer.metrics import data_metrics, rollout_probs_diff, throughput_metrics
from hybridflow.trajectory import reward_columns
from hybridflow.trainer.rollout_correction import apply_rollout_correction
from hybridflow.trainer.timeline import StageTimeline, timer
from hybridflow.trainer.reward_process import PendingModelScores, RewardProcess, model_scoring, score_batch
from hybridflow.trainer.validation import run_validation
from hybridflow.trainer.generations import carry, dump_generations, rollout_rows, take_carried


class PPOTrainer:
    """``groups``: role -> WorkerGroup (``actor_rollout_ref``; optional ``critic``, ``ref``,
    ``reward_model``, and ``rollout``: the rollout's own pool, hybrid_engine=false), already created
    by the recipe. ``reward_manager`` scores decoded responses."""

    def __init__(self, cfg, groups: dict, tokenizer, train_loader, val_loader, reward_manager, tracker,
                 progress: bool = True):
        self.cfg, self.groups, self.tokenizer = cfg, groups, tokenizer
        self.train_loader, self.val_loader = train_loader, val_loader
        self.reward_manager, self.tracker, self.progress = reward_manager, tracker, progress
        algo = cfg.algorithm
        self.estimator = get_advantage_estimator(algo.adv_estimator)
        self.actor = groups["actor_rollout_ref"]
        self.ref = groups.get("ref", self.actor)  # colocated: the actor worker hosts the ref engine
        self.critic = groups.get("critic")
        self.rm = groups.get("reward_model")
        # hybrid_engine=false: generation on a pool of its own, reading the loader ahead of training
        # (trainer/async_rollout.py); else the actor's own workers generate, batch by batch
        self.rollout_pool = groups.get("rollout")
        self.batches = train_loader if self.rollout_pool is None else AheadLoader.from_config(
            cfg, train_loader, self.actor, self.rollout_pool, self.estimator.needs_greedy_baseline)
        self.generator = self.rollout_pool or self.actor
        self.answer_lengths = AnswerLengths()  # rollout.reallocation.deal_by_length deals each epoch by the last's
        self.use_ref = cfg.actor_rollout_ref.actor.use_kl_loss or algo.use_kl_in_reward
        # placement=separate: the roles whose processes are not the actor's are started without
        # waiting and collected when needed, so the two pools work at once (HybridFlow's point of
        # separate placement); their timing_s/* then count only the wait the overlap did not hide
        side = {"ref": self.ref, "critic": self.critic, "reward_model": self.rm}
        self.overlapped = {role for role, group in side.items() if group is not None and group is not self.actor
                           and cfg.trainer.overlap_separate_pools and set(group.pids).isdisjoint(self.actor.pids)}
        actor = cfg.actor_rollout_ref.actor
        # strictly on-policy: no separate old-log-prob forward (config/resolve.py strictly_on_policy)
        self.on_policy = actor.recompute_old_log_prob == "skip"
        self.bypass = bypass_old_log_prob(cfg)
        # verl's rollout correction (trainer/rollout_correction.py); None when off
        self.rollout_correction = algo.rollout_correction if rollout_correction_on(algo.rollout_correction) else None
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl,
                                          algo.kl_ctrl.horizon)
        # the reward function scores in its own process while the workers compute old log-probs,
        # reference log-probs and values (validate warns where the key cannot apply)
        self.reward_process = (RewardProcess(tokenizer, reward_manager) if reward_fn_runs_async(cfg)
                               else None)
        # stage_fusion.enable: generation streamed into reward and inference (trainer/fused_rollout.py)
        self.fused = fused_rollout_for(self) if cfg.stage_fusion.enable and self.rollout_pool is None else None
        tp, pp = model_parallel(actor.strategy, actor.megatron)
        self.actor_dp = self.actor.world_size // (tp * pp)  # the chunks the update's dispatch deals out
        self.global_step = 0
        self.total_steps = self._total_steps()
        self.timeline = StageTimeline(groups, cfg.trainer.timeline)  # trainer/timeline.py

    def _total_steps(self) -> int:
        t = self.cfg.trainer
        per_epoch = len(self.train_loader) * t.total_epochs
        return min(t.total_training_steps, per_epoch) if t.total_training_steps else per_epoch

    # ------------------------------------------------------------------ the run
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        self._maybe_resume()
        if self.rollout_pool is not None:  # its first weights: the model's, or the checkpoint's
            self.batches.sync(self.global_step, {})
        if not t.val_only and hasattr(self.tracker, "drop_after"):  # a fresh run starts a clean record
            self.tracker.drop_after(self.global_step or -1)
        history = []
        if self.val_loader is not None and (t.val_only or (t.val_before_train and self.global_step == 0)):
            val = self.validate()
            self.tracker.log(val, step=self.global_step)
            history.append({"step": self.global_step, **val})
        if t.val_only:  # verl's evaluation run: the model, or the checkpoint resumed, and stop
            return history
        if self.global_step >= self.total_steps:  # a finished run started again: say so, then export
            past = (f"; the checkpoint is past the {self.total_steps} steps asked for, and the model stays "
                    f"at step {self.global_step}" if self.global_step > self.total_steps else "")
            print(f"nothing to train: resumed at step {self.global_step}, the run's last step{past}", flush=True)
        bar = _progress(self.total_steps, self.global_step, self.progress)
        save_time = {}
        while self.global_step < self.total_steps:
            batch = DataProto.from_single_dict(self.batches.next_batch())
            self.global_step += 1
            metrics = self.step(batch)
            last = self.global_step == self.total_steps
            if self.val_loader is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                with timer("testing", metrics):
                    metrics.update(self.validate())
            metrics["training/global_step"] = self.global_step
            metrics["training/epoch"] = self.batches.epoch
            metrics.update(save_time)  # the previous step's save, which ran after its record was logged
            # logged before the checkpoint: a kill between the two leaves the record of a step the
            # resume trains again, which drop_after removes; the other order lost the record
            self.tracker.log(metrics, step=self.global_step)
            history.append({"step": self.global_step, **metrics})
            stop_if_non_finite(metrics, self.global_step, t.default_local_dir)  # before it is saved
            save_time = {}
            if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                with timer("save_checkpoint", save_time):
                    self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
        bar.close()
        return history

    def step(self, batch: DataProto) -> dict:
        cfg, metrics = self.cfg, {}
        with self.timeline.step(self.global_step, metrics), timer("step", metrics):
            batch, baselines, filter_values, pending = self._rollout(batch, metrics)
            if cfg.algorithm.filter_groups.enable:
                batch, baselines = self._keep_informative_prompts(batch, baselines, filter_values, metrics)
            if self.rollout_pool is not None:  # of the rows trained on (dynamic sampling: several batches)
                metrics.update(staleness_metrics(batch.batch["rollout_weight_version"], self.global_step))
            order = None
            if cfg.trainer.balance_batch:  # even the tokens each data-parallel rank computes
                order, balance_metrics = balanced_order(batch.batch["attention_mask"].sum(-1),
                                                        batch.non_tensor_batch["uid"], self.actor_dp)
                batch = batch.reorder(order)
                baselines = None if baselines is None else baselines[order]
                metrics.update(balance_metrics)
            carried = take_carried(batch)  # the dump's texts: they followed the rows this far, not to the workers
            # a role on a pool of its own starts now and works while the actor's pool does
            # (unless stage fusion computed them during generation)
            ref = (self._start("ref", "compute_ref_log_prob", batch)
                   if self.use_ref and "ref_log_prob" not in batch.keys() else None)
            values = (self._start("critic", "compute_values", batch)
                      if self.critic is not None and "values" not in batch.keys() else None)
            if self.bypass:  # verl's bypass mode: pi_old is the sampler's own, no forward
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            elif not self.on_policy:
                if "old_log_probs" not in batch.keys():  # else computed during generation (stage_fusion)
                    with timer("old_log_prob", metrics):
                        batch.union(self.actor.compute_log_prob(batch))
                if "rollout_log_probs" in batch.keys():
                    metrics.update(rollout_probs_diff(batch))
            if ref is not None:
                with timer("ref", metrics):
                    batch.union(ref.get())
            if values is not None:
                with timer("values", metrics):
                    batch.union(values.get())
            if pending is not None:  # scored in the reward process meanwhile
                with timer("reward", metrics):  # only what the overlap did not hide
                    self._apply_scores(batch, pending.result(), metrics, order)
                carried = take_carried(batch)

            if self.rollout_correction is not None:  # verl's place: after pi_old, before the advantages
                metrics.update(apply_rollout_correction(batch, self.rollout_correction))
            with timer("adv", metrics):
                self.compute_advantages(batch, baselines, metrics)
            self._update(batch, metrics)
            if self.rollout_pool is not None:  # the new weights to the rollout's own pool
                self.batches.weights_updated(self.global_step, metrics)
        metrics.update(data_metrics(batch, use_critic=self.critic is not None))
        metrics.update(throughput_metrics(batch, metrics, self.actor.world_size + (
            self.rollout_pool.world_size if self.rollout_pool is not None else 0)))
        if carried is not None:  # trainer.rollout_data_dir
            with timer("dump_rollout", metrics):
                dump_generations(cfg.trainer.rollout_data_dir, self.global_step,
                                 rollout_rows(batch, carried, self.tokenizer))
        return metrics

    def _update(self, batch: DataProto, metrics: dict) -> None:
        """The critic's update, then the actor's (verl's order); with stage_fusion's
        fuse_actor_critic_update both in one pipeline schedule (workers/fused_update.py)."""
        actor_trains = self.global_step >= self.cfg.trainer.critic_warmup  # verl: critic_warmup - 1 critic-only steps
        if actor_trains and self.critic is not None and self.cfg.stage_fusion.fuse_actor_critic_update:
            with timer("update_actor_critic", metrics):
                metrics.update(_mean_dicts(self.actor.update_actor_and_critic(batch)))
            return
        if self.critic is not None:
            with timer("update_critic", metrics):  # on a pool of its own it only starts here
                critic_update = self._start("critic", "update_critic", batch, at_once=True)
        if actor_trains:
            with timer("update_actor", metrics):
                metrics.update(_mean_dicts(self.actor.update_actor(batch)))
        if self.critic is not None:  # on a pool of its own it trained while the actor did
            with timer("update_critic", metrics):
                metrics.update(_mean_dicts(critic_update.get()))

    def _start(self, role: str, method: str, batch: DataProto, at_once: bool = False):
        """``role``'s group's ``method(batch)``; ``get()`` gives its result (trainer/pool_calls.py:
        submitted now on a pool of its own, else made in turn at ``get()``, or now ``at_once``)."""
        group = {"ref": self.ref, "critic": self.critic}[role]
        return pool_calls.start(group, method, batch, role in self.overlapped, at_once)

    # ------------------------------------------------------------------ pieces
    def _rollout(self, batch: DataProto, metrics: dict):
        """Generate ``rollout.n`` responses per prompt and score them: (the batch, one row per
        response; ReMax's baselines or None; dynamic sampling's per-row metric values or None;
        None, or the pending scores when the reward process or, on a separate pool, the reward
        model computes them, in which case the batch has no ``token_level_scores`` yet)."""
        n = self.cfg.actor_rollout_ref.rollout.n
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        gen_in = generation_request(batch, self.cfg.actor_rollout_ref.rollout.multi_turn.enable, n=n)
        greedy = scoring = None
        with timer("gen", metrics):
            if self.fused is not None:  # with reward and inference on chunks as they finish
                gen_out, scoring = self.fused.run(gen_in, batch, n, metrics)
            elif self.rollout_pool is None:  # rollout.reallocation.enable: streamed, samples moved between ranks
                gen_out = generate(self.actor, gen_in, n, self.cfg.actor_rollout_ref.rollout.reallocation,
                                   self.answer_lengths)
                metrics.update(gen_out.meta_info.pop("metrics", {}))
            else:  # generated ahead on the rollout's pool, greedy baseline included
                gen_out, greedy = self.batches.generations(metrics)
        baselines = None
        if self.estimator.needs_greedy_baseline:  # ReMax (Li et al. 2023): greedy reward as the baseline
            with timer("gen_max", metrics):
                if greedy is None:
                    greedy = self.actor.generate_sequences(greedy_request(gen_in))
                    greedy.meta_info.pop("metrics", None)
                greedy.non_tensor_batch.update(batch.non_tensor_batch)
                baselines = torch.tensor(self.score(greedy)[1]).repeat_interleave(n)
        batch = batch.repeat(n, interleave=True)
        batch.pop(list(TENSOR_KEYS))  # the rollout's output carries prompt + response
        batch.union(gen_out)
        fg = self.cfg.algorithm.filter_groups
        if scoring is not None:  # scored chunk by chunk during generation
            self._apply_scores(batch, scoring, metrics)
            return batch, baselines, metric_values(fg.metric, scoring[1], scoring[3]) if fg.enable else None, None
        if self.reward_process is not None:  # a snapshot: the step goes on changing the batch's columns
            return batch, baselines, None, self.reward_process.submit(batch.select(reward_columns(batch.batch)))
        if "reward_model" in self.overlapped and not fg.enable:  # scored on the other pool meanwhile
            return batch, baselines, None, PendingModelScores(self.rm.submit("compute_rm_score", batch))
        with timer("reward", metrics):
            scoring = self.score(batch)
            self._apply_scores(batch, scoring, metrics)
        return batch, baselines, metric_values(fg.metric, scoring[1], scoring[3]) if fg.enable else None, None

    def _apply_scores(self, batch: DataProto, scoring: tuple, metrics: dict, order=None) -> None:
        """Put ``score``'s token-level scores on the batch, and for the rollout dump its texts and
        reward fields; ``order``: the batch's rows were reordered after scoring."""
        token_scores, _, reward_metrics, extra, texts = scoring
        batch.batch["token_level_scores"] = token_scores if order is None else token_scores[order]
        metrics.update(reward_metrics)
        if self.cfg.trainer.rollout_data_dir:  # the dump reuses these texts: no second decode
            carry(batch, texts, extra, order)

    def _keep_informative_prompts(self, batch: DataProto, baselines, values, metrics: dict):
        """DAPO's dynamic sampling: keep the prompts whose samples differ, generating further
        batches from the loader until ``data.train_batch_size`` of them are found."""
        fg, want = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        n = self.cfg.actor_rollout_ref.rollout.n
        kept, kept_baselines, found, seen, generated = [], [], 0, 0, 1
        while True:
            seen += len(batch) // n
            rows = torch.from_numpy(np.flatnonzero(informative_rows(batch.non_tensor_batch["uid"], values)))
            kept.append(batch[rows])
            kept_baselines.append(None if baselines is None else baselines[rows])
            found += len(rows) // n
            if found >= want:
                break
            if 0 < fg.max_num_gen_batches <= generated:
                raise DynamicSamplingError(
                    f"algorithm.filter_groups: {found} of the {want} prompts had samples that differ after "
                    f"{generated} generation batches (max_num_gen_batches); raise it (0: no cap) or use data "
                    "the model sometimes solves")
            generated += 1
            batch, baselines, values, _ = self._rollout(DataProto.from_single_dict(self.batches.next_batch()),
                                                        metrics)
        metrics.update({"filter_groups/num_gen_batches": generated, "filter_groups/kept_prompts_frac":
                        found / seen})
        batch = DataProto.concat(kept)[: want * n]
        baselines = None if kept_baselines[0] is None else torch.cat(kept_baselines)[: want * n]
        return batch, baselines

    def score(self, batch: DataProto):
        """(token_level_scores [B,R], per-sample scores, metrics, the reward function's extra fields
        per sample, the decoded responses or None) from the RM or the reward function."""
        if self.rm is not None:
            return model_scoring(self.rm.compute_rm_score(batch))
        return score_batch(self.tokenizer, self.reward_manager, batch)

    def close(self) -> None:
        """Stop the reward function's child processes (custom_reward_function.timeout_s): the reward
        process's and this one's (inline and validation scoring); else they outlive the run's end."""
        if self.reward_process is not None:
            self.reward_process.shutdown()
        if hasattr(self.reward_manager, "close"):
            self.reward_manager.close()

    def compute_advantages(self, batch: DataProto, baselines, metrics: dict) -> None:
        algo, b = self.cfg.algorithm, batch.batch
        if algo.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                                   b["response_mask"], self.kl_ctrl, algo.kl_penalty)
            b["token_level_rewards"] = rewards
            metrics.update(kl_metrics)
        else:
            b["token_level_rewards"] = b["token_level_scores"]
        adv, ret = compute_advantage(
            algo.adv_estimator, b["token_level_rewards"], b["response_mask"],
            index=batch.non_tensor_batch["uid"], values=b["values"] if "values" in b.keys() else None,
            reward_baselines=baselines, gamma=algo.gamma, lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std_in_grpo)
        b["advantages"], b["returns"] = adv, ret

    def validate(self) -> dict:
        """Greedy (by default) generation on the whole validation set (trainer/validation.py)."""
        return run_validation(self)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """global_step_N/: engines (+ worker RNG) first, trainer state, then the manifest that
        completes the folder, then the tracker that names it (layout: trainer/checkpoint.py). A save
        that fails (a full disk) removes its partial folder; the tracker still names the previous one."""
        t = self.cfg.trainer
        path = ckpt.start_save(t.default_local_dir, self.global_step)
        with ckpt.removed_if_unfinished(path):
            return self._save_into(path)

    def _save_into(self, path: str) -> str:
        t = self.cfg.trainer
        roles = [("actor", self.actor, self.cfg.actor_rollout_ref.actor.checkpoint)]
        if self.critic is not None:
            roles.append(("critic", self.critic, self.cfg.critic.checkpoint))
        for name, group, contents in roles:
            group.save_checkpoint(os.path.join(path, name))
            if "hf_model" in contents.save_contents:  # verl's place for it; listed in the manifest too
                group.save_hf(os.path.join(path, name, ckpt.HF_META_DIR))
        keep = ckpt.folders_to_keep(t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep, self.critic is not None)
        if self.rollout_pool is not None:  # its random state, where it samples the next batch from
            self.rollout_pool.save_checkpoint(os.path.join(path, "rollout"))
        return ckpt.finish_save(t.default_local_dir, self.global_step,
                                {"loader": self.batches.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()},
                                self.worker_layout(), keep)

    def worker_layout(self) -> dict:
        return worker_layout(self.cfg)

    def _maybe_resume(self) -> None:
        t = self.cfg.trainer
        found = ckpt.open_resume(t.default_local_dir, t.resume_mode, self.worker_layout())
        if not t.val_only:  # saves that never finished, past where this run starts, are not checkpoints
            ckpt.remove_partial(t.default_local_dir, found[1]["global_step"] if found else 0)
        if found is None:
            return
        path, state = found
        if not t.val_only:  # an evaluation need not use the training data's settings
            self.batches.load_state_dict(state["loader"])  # first: it refuses other data cheaply
        self.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(path, "critic"))
        if self.rollout_pool is not None and os.path.isdir(os.path.join(path, "rollout")):  # else a hybrid run's
            self.rollout_pool.load_checkpoint(os.path.join(path, "rollout"))
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.set_controller_rng_state(state["rng"])
        self.global_step = state["global_step"]
        print(f"resumed from {path} at step {self.global_step}", flush=True)


def _mean_dicts(dicts) -> dict:
    if isinstance(dicts, dict):
        return dicts
    keys = set().union(*dicts)
    return {k: float(combine_metric(k, [d[k] for d in dicts if k in d], [1.0] * sum(k in d for d in dicts)))
            for k in keys}


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", disable=not enabled, dynamic_ncols=True)
