"""Per-step metrics under verl's names, computed on the controller from the step's batch."""
from __future__ import annotations

import torch

from hybridflow.algorithms import explained_variance, masked_mean
from hybridflow.trajectory import agent_step_metrics, response_token_mask


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


# The long-tail workload's profile is stated at p50 / p80 / p95 (docs/benchmarks.md): a mean hides
# the few long answers the whole batch waits for.
LENGTH_PERCENTILES = (50, 80, 95)


def _percentiles(prefix: str, values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values.float(), torch.tensor([p / 100 for p in LENGTH_PERCENTILES]))
    return {f"{prefix}/p{p}": float(v) for p, v in zip(LENGTH_PERCENTILES, q)}


def data_metrics(batch, use_critic: bool) -> dict[str, float]:
    b = batch.batch
    mask = b["response_mask"].float()  # generated tokens (a multi-turn response's tool tokens are not)
    lengths = response_token_mask(b).float().sum(-1)  # multi-turn: the whole trajectory, as verl counts it
    prompt_lengths = b["attention_mask"][:, : -mask.shape[1]].sum(-1).float()
    out = {}
    out.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", b["advantages"][mask.bool()]))
    out.update(_stats("critic/returns", b["returns"][mask.bool()]))
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = float((lengths == mask.shape[1]).float().mean())
    out.update(_percentiles("response_length", lengths))
    out.update(_stats("prompt_length", prompt_lengths))
    if use_critic:
        values = b["values"]
        out.update(_stats("critic/values", values[mask.bool()]))
        out["critic/vf_explained_var"] = float(explained_variance(values, b["returns"], mask))
    out.update(agent_step_metrics(b))  # multi-turn batches: turns, tool calls, errors, tokens
    return out


def rollout_probs_diff(batch) -> dict[str, float]:
    """How far the sampler's probabilities are from the actor's recomputation of the same tokens
    (a resharding or numerics bug shows up here first)."""
    b = batch.batch
    mask = b["response_mask"].bool()
    diff = (b["rollout_log_probs"].float().exp() - b["old_log_probs"].float().exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_log_probs_diff_mean": float(
                masked_mean((b["rollout_log_probs"] - b["old_log_probs"]).abs(), mask.float()))}


def throughput_metrics(batch, metrics: dict, n_workers: int) -> dict[str, float]:
    tokens = float(batch.batch["attention_mask"].sum())
    step_time = metrics.get("timing_s/step", float("nan"))
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
            "perf/throughput": tokens / step_time / max(n_workers, 1)}
