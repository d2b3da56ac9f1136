"""The pieces of a PPO update the actor's, the critic's and the fused update share: how a worker's
rows are cut into mini-batches, each role's loss function and per-step metrics, and the means
reported over the steps: ``update_critic`` (critic.py), ``update_actor_and_critic``
(fused_update.py) and ``update_actor`` (actor_rollout_ref.py) each cut, train and report alike.
The means are per key over the steps that reported the key (the actor's rule; the critic's keys
appear at every step, so for them it is the plain mean over steps it always was)."""
from __future__ import annotations

from typing import Iterator

from hybridflow.algorithms.objectives import count_skipped_rows, make_actor_loss_fn, make_critic_loss_fn
from hybridflow.protocol import DataProto


def mini_batch_rows(method: str, data: DataProto, mini_batch_size: int, dp_size: int) -> int:
    """Rows per mini-batch on this rank; a clear error when ``data`` does not split into them."""
    rows = mini_batch_size // dp_size
    if rows < 1 or len(data) % rows:
        raise ValueError(f"{method}: {len(data)} rows on this rank do not split into mini-batches of {rows} "
                         f"(ppo_mini_batch_size {mini_batch_size} over {dp_size} dp ranks)")
    return rows


def mini_batches(method: str, settings, data: DataProto, dp_size: int) -> Iterator[DataProto]:
    """``settings.ppo_epochs`` passes over ``data`` in mini-batches (settings: the role's, with
    ppo_mini_batch_size, ppo_epochs, shuffle, seed)."""
    rows = mini_batch_rows(method, data, settings.ppo_mini_batch_size, dp_size)
    return data.make_iterator(rows, epochs=settings.ppo_epochs, shuffle=settings.shuffle, seed=settings.seed)


def prepare_actor_batch(settings, data: DataProto) -> None:
    """The actor trains at the sampling temperature and reports entropy (meta_info, in place)."""
    data.meta_info.update(temperature=float(data.meta_info.get("temperature", settings.temperature)),
                          calculate_entropy=True)


def actor_loss_fn(settings):
    return make_actor_loss_fn(settings.objective)


def actor_skip_rows(settings, mini: DataProto):
    """Rows whose actor loss is identically zero (train_batch's ``skip_rows``)."""
    return settings.objective.inert_rows(mini.batch)


def actor_step_metrics(step: dict[str, float], mini: DataProto) -> dict[str, float]:
    return count_skipped_rows(step, on_policy="old_log_probs" not in mini.batch.keys())


def critic_loss_fn(settings):
    return make_critic_loss_fn(settings.cliprange_value, settings.loss_agg_mode)


class MetricMeans:
    """Each metric's mean over the optimizer steps that reported it, under ``role/`` unless the
    key already names its section (a mini-batch whose rows were all skipped reports no entropy)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, role: str, step: dict[str, float]) -> None:
        for k, v in step.items():
            key = k if "/" in k else f"{role}/{k}"
            self.sums[key] = self.sums.get(key, 0.0) + float(v)
            self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: v / self.counts[k] for k, v in self.sums.items()}
