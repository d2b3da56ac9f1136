"""Reducing a per-token loss matrix [B, R] to the scalar that is back-propagated.

The choice matters for long responses: "token-mean" weights every token equally (DAPO, Yu et
al. 2025, "token-level policy gradient loss"), "seq-mean-token-mean" weights every sequence equally (the original GRPO
objective, Shao et al. 2024, eq. 3, with its 1/|o_i| length normalisation), and
"seq-mean-token-sum-norm" divides by a constant instead of each length (Dr. GRPO, Liu et al.
2025), which removes the length bias of 1/|o_i|.

Registry: `LOSS_AGG_MODES` below lists every mode; `get_loss_agg(name)` looks one up.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from hybridflow.algorithms.masked import masked_mean, masked_sum

LossAggFn = Callable[[Tensor, Tensor, int | None], Tensor]


def _nonempty_rows(loss_mask: Tensor) -> Tensor:
    return loss_mask.sum(dim=-1) > 0


def token_mean(loss_mat: Tensor, loss_mask: Tensor, norm_length: int | None = None) -> Tensor:
    """sum over all valid tokens / number of valid tokens (DAPO's token-level loss)."""
    return masked_mean(loss_mat, loss_mask)


def seq_mean_token_sum(loss_mat: Tensor, loss_mask: Tensor, norm_length: int | None = None) -> Tensor:
    """mean over sequences of each sequence's token sum. Sequences with no valid token are left
    out of the mean (instead of counting as 0) so an empty response does not dilute the loss."""
    keep = _nonempty_rows(loss_mask)
    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    return seq_sums[keep].sum() / keep.sum().clamp(min=1)


def seq_mean_token_mean(loss_mat: Tensor, loss_mask: Tensor, norm_length: int | None = None) -> Tensor:
    """mean over sequences of each sequence's token mean (GRPO eq. 3's 1/G sum_i 1/|o_i| sum_t).
    Sequences with no valid token are left out, as in `seq_mean_token_sum`."""
    keep = _nonempty_rows(loss_mask)
    seq_means = masked_mean(loss_mat, loss_mask, dim=-1)
    return seq_means[keep].sum() / keep.sum().clamp(min=1)


def seq_mean_token_sum_norm(loss_mat: Tensor, loss_mask: Tensor, norm_length: int | None = None) -> Tensor:
    """Dr. GRPO: mean over sequences of (token sum / norm_length), norm_length defaulting to the
    padded response length R (a constant, so no per-length bias).

    Differs from verl, which divides the *sum* over sequences by R (so its value grows with the
    micro-batch size); here the sequences are averaged, which keeps the loss comparable across
    micro-batch sizes under gradient accumulation. Empty sequences are kept (they add 0), because
    the normaliser is a constant by design.
    """
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    if length <= 0:
        raise ValueError(f"norm_length must be positive for seq-mean-token-sum-norm, got {length}")
    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    return seq_sums.mean() / length


def agg_loss_parts(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str,
                   norm_length: int | None = None) -> tuple[Tensor, Tensor]:
    """(numerator, denominator) with ``agg_loss = numerator / denominator`` for one batch, where
    both parts *add up* over disjoint sets of rows. Summing them over every micro-batch and
    data-parallel rank of a mini-batch gives the mode's value on the whole mini-batch, which is
    what hybridflow/algorithms/mini_batch_agg.py back-propagates.

    The denominator depends on the mask alone: tokens (token-mean), non-empty rows
    (seq-mean-token-*), or all rows (seq-mean-token-sum-norm, whose numerator carries the 1/L).
    """
    get_loss_agg(loss_agg_mode)  # the same error for an unknown name
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return (loss_mat * mask).sum(), mask.sum()
    keep = _nonempty_rows(loss_mask)
    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums[keep].sum(), keep.sum().to(loss_mat.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, loss_mask, dim=-1)[keep].sum(), keep.sum().to(loss_mat.dtype)
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    return seq_sums.sum() / length, torch.tensor(float(loss_mat.shape[0]), dtype=loss_mat.dtype)


LOSS_AGG_MODES: dict[str, LossAggFn] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def get_loss_agg(name: str) -> LossAggFn:
    """The aggregation function called `name`; ValueError listing the known modes otherwise."""
    try:
        return LOSS_AGG_MODES[name]
    except KeyError:
        raise ValueError(
            f"unknown loss_agg_mode {name!r}; known: {sorted(LOSS_AGG_MODES)} "
            "(set actor_rollout_ref.actor.loss_agg_mode to one of them)"
        ) from None


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, norm_length: int | None = None) -> Tensor:
    """Reduce `loss_mat` [B, R] over `loss_mask` [B, R] with the named mode to a scalar."""
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(loss_mat.shape)} != loss_mask shape {tuple(loss_mask.shape)}"
        )
    return get_loss_agg(loss_agg_mode)(loss_mat, loss_mask, norm_length)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) * z.

    Written through logsumexp so that it stays finite for very peaked distributions, where
    -sum p log p would multiply 0 by -inf.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def agg_entropy(entropy: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """Per-token entropy [B, R] reduced like a loss (used for the entropy bonus and the
    `actor/entropy` metric); same modes as `agg_loss`."""
    return agg_loss(entropy, response_mask, loss_agg_mode)
