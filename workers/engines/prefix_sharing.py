"""One forward of each distinct prompt for a micro-batch whose rows share prompts (GRPO groups).

Textbook RL trainers (verl, TRL, OpenRLHF) feed each of a prompt's n samples as its own row, so
the prompt goes through the model n times in every log-prob, reference and update pass. Here the
distinct prompts go through once with ``use_cache=True``; their key/value cache is indexed out to
every row (``DynamicCache.batch_select_indices``, a differentiable gather) and the responses run on
top of it. In backward the n responses' gradients meet in the one prompt pass, so outputs and
gradients equal the per-row forward up to fp32 summation order, for less compute: a micro-batch of
m rows and U distinct prompts skips ``(m - U) * prompt_columns`` token positions.

The helpers work on the padded layout of ``FSDPEngine._padded_head_inputs`` (left-padded prompts
in columns ``[start, P)``, right-padded responses after). The last response column is never an
input: its output would predict a token past the response. The Megatron engine uses
``distinct_prompts`` and ``saves_enough`` too; its own model (``MegatronCausalLM``) does the
sharing in one call per layer instead of the two HF calls of ``shared_prefix_logits``.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Share only when it skips at least this fraction of the micro-batch's token positions: below it
# the second model call (and, when parameters are sharded, its second all-gather) costs more.
MIN_SAVED_FRACTION = 0.1


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, start: int,
                     prompt_len: int) -> tuple[Tensor, Tensor]:
    """``(first_rows [U], inverse [m])``: one representative row per distinct prompt over the
    prompt columns ``[start, prompt_len)``, and each row's prompt number.

    Rows count as the same prompt only if token ids, mask and position ids all agree, so the cached
    keys and values are exactly what each row's own forward would compute.
    """
    rows = input_ids.shape[0]
    mask = attention_mask[:, start:prompt_len]
    key = torch.cat([input_ids[:, start:prompt_len] * mask, mask, position_ids[:, start:prompt_len]], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    first_rows = torch.full((unique.shape[0],), rows, dtype=torch.long, device=input_ids.device)
    first_rows.scatter_reduce_(0, inverse, torch.arange(rows, device=input_ids.device), reduce="amin")
    return first_rows, inverse


def saves_enough(first_rows: Tensor, rows: int, prompt_cols: int, input_cols: int) -> bool:
    """Whether sharing skips at least ``MIN_SAVED_FRACTION`` of the ``rows x input_cols`` token
    positions a micro-batch feeds the model (``prompt_cols`` of them are prompt columns)."""
    saved = (rows - len(first_rows)) * prompt_cols
    return saved > 0 and saved >= MIN_SAVED_FRACTION * rows * input_cols


def shared_prefix_logits(module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                         start: int, prompt_len: int, end: int, first_rows: Tensor, inverse: Tensor,
                         critic: bool = False) -> Tensor:
    """Head outputs ``[m, end - prompt_len, V or 1]`` at positions ``[P-1, end-1)``: column t
    predicts response token t (or holds its value, for a critic), as in the per-row forward.

    ``module`` is a causal LM or, with ``critic``, a token-classification critic; the cache object
    is created here and filled in place, since the critic's output does not return it. Of the
    prompt pass only the last position's head output is used, so a causal LM computes its
    vocabulary logits there alone (``logits_to_keep=1``, as the per-row forward keeps the response
    span): at a 150k vocabulary the LM head is a quarter of a small model's per-token FLOPs, and
    ``U x prompt x V`` fp32 logits are gigabytes at long prompts.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    last_only = {} if critic else {"logits_to_keep": 1}  # a token-classification head takes no such argument
    prompt_out = module(input_ids=input_ids[first_rows, start:prompt_len],
                        attention_mask=attention_mask[first_rows, start:prompt_len],
                        position_ids=position_ids[first_rows, start:prompt_len],
                        past_key_values=cache, use_cache=True, **last_only)
    first = prompt_out.logits[:, -1:][inverse]  # the last prompt position predicts response token 0
    if end - 1 == prompt_len:  # only one response column: nothing runs on top of the cache
        return first
    cache.batch_select_indices(inverse)
    # the 2D mask covers cached and new columns; transformers offsets the causal mask by the cache length
    rest = module(input_ids=input_ids[:, prompt_len:end - 1], attention_mask=attention_mask[:, start:end - 1],
                  position_ids=position_ids[:, prompt_len:end - 1], past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], dim=1)

