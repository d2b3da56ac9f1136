"""Statistics over the valid (mask == 1) entries of a padded [B, R] tensor.

Every RL quantity in this package lives on right-padded response tokens; padding must never
enter a mean, a variance or a whitening. These helpers are the one place that rule is written.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_same_shape(values: Tensor, mask: Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}; "
            "pass a response_mask with the same [B, R] shape as the tensor it masks"
        )


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is 1 (over `dim`, or over everything when dim is None)."""
    _check_same_shape(values, mask)
    # where() rather than multiply: padding may hold inf/nan (e.g. log-prob of a pad token)
    # and 0 * inf would poison the sum.
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over entries where `mask` is 1.

    Differs from a plain `sum / count`: an all-zero mask (or an all-zero row when `dim` is
    given) yields 0 instead of nan, so one empty response cannot turn a metric into nan.
    """
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries (a scalar). `unbiased` applies Bessel's n/(n-1) correction,
    which matches `torch.var`; with fewer than two valid entries the correction is skipped."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        if n >= 2:
            var = var * n / (n - 1)
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) with mean and (unbiased) var over valid entries only.

    With `shift_mean=False` the mean is added back (scale-only normalisation). Padding positions
    are returned as 0, unlike a plain whitening, so downstream sums over the mask are unaffected
    by what the padding used to hold.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
