"""Loss aggregation over a whole mini-batch, across micro-batches and data-parallel ranks.

The textbook objective of one optimizer step is ``agg(loss_mat)`` over the mini-batch: e.g. the
token mean over every response token of every row (DAPO's token-level loss). Gradient
accumulation computes it in micro-batches on several ranks, and the classic implementation
(verl before its loss-scaling fix, most PPO code) averages per-micro-batch means instead, so the
gradient depends on the micro-batch size and on how rows happen to be grouped. Here every
micro-batch back-propagates its *share* of the mini-batch value:

    loss_micro = numerator(micro) / denominator(mini-batch on all ranks)

(numerator/denominator from ``loss_agg.agg_loss_parts``). These add up to the exact mini-batch
value whatever the micro-batch size, the data-parallel size, or which rows a rank holds. That
also makes it exact to leave out rows whose loss and gradient are identically zero (GRPO rows
with zero advantage), as long as the denominator still counts them; the engines do that
(workers/engines/base.py ``compact_rows``).

The training engine scales each micro-batch loss by ``m / M`` (micro rows over this rank's rows)
and its gradient reduction averages over ``dp`` ranks; ``mini_batch_agg`` multiplies by
``dp * M / m`` to cancel both. The engine puts the numbers into every micro-batch's meta_info
under the keys below.
"""
from __future__ import annotations

from torch import Tensor

from hybridflow.algorithms.loss_agg import agg_loss_parts

META_DP_SIZE = "dp_size"                          # data-parallel ranks the gradient is averaged over
META_MINI_BATCH_ROWS = "mini_batch_rows"          # rows of the mini-batch on this rank (as trained)
META_GLOBAL_TOKENS = "mini_batch_response_tokens"  # response tokens of the mini-batch, all ranks
META_GLOBAL_ROWS = "mini_batch_rows_all_ranks"     # rows of the mini-batch, all ranks
META_GLOBAL_NONEMPTY_ROWS = "mini_batch_nonempty_rows"  # rows with >= 1 response token, all ranks
REQUIRED_META = (META_DP_SIZE, META_MINI_BATCH_ROWS, META_GLOBAL_TOKENS, META_GLOBAL_ROWS,
                 META_GLOBAL_NONEMPTY_ROWS)


def global_denominator(meta: dict, loss_agg_mode: str) -> float:
    """The mode's denominator over the whole mini-batch on all ranks (see agg_loss_parts)."""
    if loss_agg_mode == "token-mean":
        return float(meta[META_GLOBAL_TOKENS])
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(meta[META_GLOBAL_NONEMPTY_ROWS])
    return float(meta[META_GLOBAL_ROWS])


def mini_batch_agg(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, micro_meta: dict, micro_rows: int,
                   norm_length: int | None = None) -> Tensor:
    """This micro-batch's share of ``agg(loss_mat)`` over the whole mini-batch, pre-scaled so that
    the engine's accumulation and data-parallel averaging leave exactly that share."""
    missing = [k for k in REQUIRED_META if k not in micro_meta]
    if missing:
        raise ValueError(f"mini_batch_agg: micro-batch meta_info lacks {missing}; call it from a loss_fn run "
                         "by a training engine's train_batch")
    numerator, _ = agg_loss_parts(loss_mat, loss_mask, loss_agg_mode, norm_length)
    scale = micro_meta[META_DP_SIZE] * micro_meta[META_MINI_BATCH_ROWS] / micro_rows
    return numerator * (scale / max(global_denominator(micro_meta, loss_agg_mode), 1.0))


def single_batch_meta(response_mask: Tensor) -> dict:
    """The meta_info for calling a loss_fn on a whole mini-batch in one process (one rank, one
    micro-batch): then ``mini_batch_agg`` equals the plain ``agg_loss``."""
    rows = int(response_mask.shape[0])
    return {META_DP_SIZE: 1, META_MINI_BATCH_ROWS: rows, META_GLOBAL_TOKENS: int(response_mask.sum()),
            META_GLOBAL_ROWS: rows, META_GLOBAL_NONEMPTY_ROWS: int((response_mask.sum(-1) > 0).sum())}
