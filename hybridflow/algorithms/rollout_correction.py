"""Rollout correction: importance weights and rejection between the sampler's and the trainer's policy.

The rollout engine (vLLM, bf16 kernels) samples from pi_rollout; the trainer's forward computes
pi_old on the same tokens, and the two differ (``training/rollout_probs_diff_*``), more so when
the samples are stale (an asynchronous trainer). The PPO ratio pi_theta / pi_old then corrects
only part of the shift; the rest is the ratio ``rho_t = pi_old(y_t) / pi_rollout(y_t)``.

Following Liu, Li, Fu, Wang, Liu, Shen (2025), "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch" (and verl's ``rollout_corr_helper``, whose key
names, defaults and ``rollout_corr/*`` metric names are kept):

- Truncated importance sampling (TIS, Yao et al. 2025): a weight per token,
  ``w_t = min(rho_t, C)`` (``rollout_is=token``), or one per sequence,
  ``w = min(prod_t rho_t, C)`` (``rollout_is=sequence``), ``C = rollout_is_threshold``. The
  weights are detached: they change the measure the gradient is averaged under, not the
  objective. ``rollout_is_batch_normalize`` divides them by their batch mean (of tokens, or of
  sequences), so the average weight is 1 and the loss's scale is kept.
- Rejection (masked importance sampling): tokens or whole sequences whose divergence statistic
  lies outside bounds leave the response mask. The statistics are verl's ``{token, seq_sum,
  seq_mean, seq_max}_{k1, k2, k3}`` on ``log rho``: k1 = -log rho (ratio bounds
  ``lower_upper``, a single value U meaning ``1/U_U``), k2 = (log rho)^2 / 2, k3 = rho - 1 - log
  rho (upper bounds). ``seq_mean_k1`` is the geometric-mean ratio (Geo-RS).

What differs from verl: log ratios are clamped at +-20 as verl does, but the token-level batch
mean is taken on the controller, over the whole batch, so there is no cross-rank reduction to do;
the metrics are a subset of verl's (the ones listed in :func:`rollout_correction`); ``bypass_mode``
(old log-probs := rollout log-probs) is not offered: the trainer always computes pi_old when a
correction is on (config/resolve.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_mean

SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: log ratios are clamped here before exponentiating (as verl)

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


class RolloutCorrection(NamedTuple):
    weights: Tensor | None  # [B, R] detached TIS weights (0 on padding), None when rollout_is is null
    response_mask: Tensor  # [B, R] the response mask with rejected tokens set to 0
    metrics: dict[str, float]  # rollout_corr/*


def parse_rs(rollout_rs: str | None) -> list[str]:
    """The rejection options of a comma-separated ``rollout_rs``, duplicates dropped, in order."""
    out = []
    for opt in (rollout_rs or "").split(","):
        opt = opt.strip()
        if opt and opt not in out:
            out.append(opt)
    return out


def parse_rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` per option: (lower, upper). One value is shared by all options, or
    one comma-separated value per option. k1 options bound the ratio: ``lower_upper``, or ``U``
    meaning ``1/U_U``; k2/k3 options take one positive upper bound. Raises ValueError."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold gives {len(parts)} thresholds for {len(options)} rollout_rs "
                         f"options: give one shared value or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = {}
    for opt, part in zip(options, parts):
        if "_" in part and not opt.endswith("k1"):
            raise ValueError(f"{opt} takes one upper bound, not a range: {part!r}")
        try:
            if opt.endswith("k1"):
                lo, hi = (float(v) for v in part.split("_", 1)) if "_" in part else (1 / float(part), float(part))
            else:
                lo, hi = None, float(part)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{part!r} for {opt} is not a number (k1: lower_upper or one number)") from None
        if hi <= 0 or (lo is not None and lo <= 0):
            raise ValueError(f"{opt}'s bounds must be positive, got {part!r}")
        out[opt] = (lo, hi)
    return out


def is_weights(log_ratio: Tensor, mask: Tensor, level: str, threshold: float,
               batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """Truncated IS weights ``min(rho, threshold)`` at ``level`` (token: rho_t; sequence:
    prod_t rho_t, the same for every token of the row), 0 on padding, optionally divided by their
    batch mean. The metrics are of the weights before truncation (verl's ``rollout_is_*``)."""
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
        high = masked_mean((raw > threshold).float(), mask)
        low = masked_mean((raw < 1 / threshold).float(), mask)
        valid = raw[mask.bool()]
    elif level == "sequence":
        seq_log = (log_ratio * mask).sum(-1, keepdim=True)
        raw = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask
        rows = mask.sum(-1) > 0
        valid = torch.exp(seq_log.squeeze(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND))[rows]
        high = (valid > threshold).float().mean() if valid.numel() else torch.zeros(())
        low = (valid < 1 / threshold).float().mean() if valid.numel() else torch.zeros(())
    else:
        raise ValueError(f"rollout_is must be token or sequence, got {level!r}")
    metrics = {"rollout_is_mean": float(masked_mean(raw, mask)),
               "rollout_is_max": float(valid.max()) if valid.numel() else 0.0,
               "rollout_is_min": float(valid.min()) if valid.numel() else 0.0,
               "rollout_is_ratio_fraction_high": float(high), "rollout_is_ratio_fraction_low": float(low)}
    weights = raw.clamp(max=threshold).detach()
    # Kish's effective sample size of the truncated weights, as a fraction of the tokens
    w = weights[mask.bool()]
    metrics["rollout_is_eff_sample_size"] = float(w.mean() ** 2 / (w.square().mean()).clamp_min(1e-12)) \
        if w.numel() else 0.0
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:  # one weight per sequence: the mean over sequences, not tokens (long rows do not count more)
            rows = mask.sum(-1) > 0
            mean = masked_mean(weights, mask, dim=-1)[rows].mean() if rows.any() else torch.zeros(())
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return weights, metrics


def rejection_mask(log_ratio: Tensor, mask: Tensor, options: list[str],
                   thresholds: dict[str, tuple[float | None, float]]) -> tuple[Tensor, dict[str, float]]:
    """``mask`` with the tokens (token_*) or whole rows (seq_*) whose statistic is out of bounds
    zeroed; every option must keep a token for it to stay. Metrics: verl's
    ``rollout_rs_masked_fraction`` (of response tokens) and ``rollout_rs_seq_masked_fraction`` (of
    rows with any token rejected), overall and per option."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1 - lr}
    keep = torch.ones_like(mask, dtype=torch.bool)
    maskb, metrics = mask.bool(), {}
    for opt in options:
        kind = opt.rsplit("_", 1)[1]
        token_stat = stats[kind]
        if opt.startswith("token_"):
            stat = token_stat
        elif opt.startswith("seq_sum_"):
            stat = (token_stat * mask).sum(-1, keepdim=True)
        elif opt.startswith("seq_mean_"):
            stat = masked_mean(token_stat, mask, dim=-1).unsqueeze(-1)
        elif opt.startswith("seq_max_"):
            stat = token_stat.masked_fill(~maskb, float("-inf")).max(-1, keepdim=True).values
        else:
            raise ValueError(f"unknown rollout_rs option {opt!r}: one of {', '.join(ROLLOUT_RS_OPTIONS)}")
        lo, hi = thresholds[opt]
        if kind == "k1":  # bounds on the ratio rho: -log rho in [log lo, log hi], as verl compares them
            ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            ok = stat <= hi
        ok = ok.expand_as(mask)
        keep &= ok
        metrics[f"rollout_rs_{opt}_masked_fraction"] = float(masked_mean((~ok).float(), mask))
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = float((~ok & maskb).any(-1).float().mean())
    new_mask = mask * keep.to(mask.dtype)
    metrics["rollout_rs_masked_fraction"] = float(masked_mean((~keep).float(), mask))
    metrics["rollout_rs_seq_masked_fraction"] = float((~keep & maskb).any(-1).float().mean())
    return new_mask, metrics


def offpolicy_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler is from the trainer: verl's ``kl`` (k1, E_rollout[log pi_rollout - log
    pi_old]), ``k3_kl``, per-sequence perplexities and their log difference."""
    m = mask.to(old_log_prob.dtype)
    log_ratio = old_log_prob - rollout_log_prob
    rows = m.sum(-1) > 0
    mean_old = masked_mean(old_log_prob, m, dim=-1)[rows]
    mean_rollout = masked_mean(rollout_log_prob, m, dim=-1)[rows]
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    log_ppl_diff = mean_rollout - mean_old  # log(ppl_old / ppl_rollout)
    if not rows.any():
        return {}
    return {"kl": float(masked_mean(-log_ratio, m)),
            "k3_kl": float(masked_mean(torch.exp(lr) - lr - 1, m)),
            "training_ppl": float(torch.exp(-mean_old).mean()),
            "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
            "log_ppl_diff": float(log_ppl_diff.mean()),
            "log_ppl_abs_diff": float(log_ppl_diff.abs().mean())}


def rollout_correction(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, *,
                       rollout_is: str | None = None, rollout_is_threshold: float = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold=None) -> RolloutCorrection:
    """The TIS weights, the response mask after rejection and the ``rollout_corr/*`` metrics for
    one batch (``log rho = old_log_prob - rollout_log_prob``). With both options null it returns
    the mask unchanged and only the off-policy metrics (verl's "metrics only" setting)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"rollout_correction: shapes differ: old_log_probs {tuple(old_log_prob.shape)}, "
                         f"rollout_log_probs {tuple(rollout_log_prob.shape)}, "
                         f"response_mask {tuple(response_mask.shape)}")
    old, roll = old_log_prob.detach().float(), rollout_log_prob.detach().float()
    mask = response_mask.float()
    log_ratio = old - roll
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        if rollout_is_threshold <= 0:
            raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
        weights, m = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    new_mask = response_mask
    options = parse_rs(rollout_rs)
    if options:
        kept, m = rejection_mask(log_ratio, mask, options, parse_rs_thresholds(options, rollout_rs_threshold))
        new_mask = kept.to(response_mask.dtype)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old, roll, mask))
    return RolloutCorrection(weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()})
