"""Validation of a PPO-family run: generation on the whole validation set (greedy by default),
scored by the reward function or model; val/score/mean and, with ``val_kwargs.n > 1``, mean@N,
best@N, ... (trainer/val_metrics.py). On the trainer's groups, as ``PPOTrainer.validate``."""
from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.trainer.async_rollout import generation_request
from hybridflow.trainer.generations import dump_generations, extras_per_row, generation_rows, write_val_generations
from hybridflow.trainer.reward_process import PendingModelScores
from hybridflow.trainer.timeline import timer
from hybridflow.trainer.val_metrics import join_columns, validation_metrics


def run_validation(trainer) -> dict:
    """Greedy (by default) generation on the whole validation set; val/score/mean, and with
    ``val_kwargs.n > 1`` mean@N, best@N, ... (trainer/val_metrics.py)."""
    vk, t = trainer.cfg.actor_rollout_ref.rollout.val_kwargs, trainer.cfg.trainer
    keep = t.log_val_generations
    scores, sources, extras, errors = [], [], [], []
    samples = []  # text rows for log_val_generations / validation_data_dir

    def take(out, scoring):  # one generated batch and its scores into the lists above
        _, batch_scores, batch_metrics, extra, texts = scoring
        errors.append(batch_metrics.get("reward/errors", 0.0))
        wanted = len(out) if t.validation_data_dir else keep - len(samples)
        if wanted > 0:
            samples.extend(generation_rows(out, batch_scores, trainer.tokenizer, texts,
                                           extras_per_row(extra, len(out)), limit=wanted))
        scores.extend(batch_scores)
        sources.extend(out.non_tensor_batch["data_source"])
        extras.append((len(out), extra))

    pending = None  # the previous batch, scored on the reward model's pool while this one generates
    if trainer.rollout_pool is not None and trainer.batches.version != trainer.global_step:
        trainer.batches.sync(trainer.global_step, {})  # validate the trainer's weights, not older ones
    for batch_dict in trainer.val_loader:
        batch = DataProto.from_single_dict(batch_dict)
        gen_in = generation_request(batch, trainer.cfg.actor_rollout_ref.rollout.multi_turn.enable,
                                    n=vk.n, do_sample=vk.do_sample, temperature=vk.temperature,
                                    top_p=vk.top_p, top_k=vk.top_k, stage="validation")
        out = trainer.generator.generate_sequences(gen_in)
        for kept in ("metrics", "stage"):  # the reward model's scoring of it is its own stage
            out.meta_info.pop(kept, None)
        out.non_tensor_batch.update(batch.repeat(vk.n, interleave=True).non_tensor_batch)
        if pending is not None:
            take(pending[0], pending[1].result())
            pending = None
        if "reward_model" in trainer.overlapped:
            pending = (out, PendingModelScores(trainer.rm.submit("compute_rm_score", out)))
        else:
            with timer("val_reward", {}):  # on the timeline's driver track
                take(out, trainer.score(out))
    if pending is not None:
        take(pending[0], pending[1].result())
    if keep:
        write_val_generations(t.default_local_dir, trainer.global_step, samples[:keep])
    if t.validation_data_dir:
        dump_generations(t.validation_data_dir, trainer.global_step, samples)
    result = validation_metrics(scores, sources, vk.n, join_columns(extras))
    if trainer.rm is None:  # samples the reward function raised on (scored 0), as reward/errors in training
        result["val/reward_errors"] = sum(errors)
    return result
