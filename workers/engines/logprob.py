"""Response log-probabilities and entropy from logits (shared by the FSDP and Megatron engines).

The alignment rule of docs/contracts.md: the log-prob of response token ``t`` (0-based) comes
from the logits at sequence position ``P + t - 1`` divided by the sampling temperature, with
``log_softmax`` over the full vocabulary.

:func:`response_log_probs` runs one fused ``log_softmax`` and reads both outputs from it (entropy
``-sum p log p`` with ``p = exp(log p)``), instead of the textbook ``logsumexp`` + ``softmax``
pair: ``logsumexp`` is several passes over the ``[.., V]`` logits forward and backward, and at a
150k vocabulary those passes, not the model, were most of the engines' overhead over a plain loop
on a GPU (scripts/bench/engines_gpu.py). The log-softmax tensor is the size of the fp32 logits,
which autograd keeps either way.
"""
from __future__ import annotations

import torch
from torch import Tensor


def response_logits(logits: Tensor, prompt_length: int, response_length: int) -> Tensor:
    """Slice ``[b, S, V]`` sequence logits to the ``[b, R, V]`` that predict the response tokens.

    Position ``P + t - 1`` predicts token ``P + t``; so the slice is ``[P-1, P-1+R)``.
    """
    if prompt_length < 1:
        raise ValueError(f"response_logits: prompt_length={prompt_length}; a response needs at least "
                         "one prompt token before it")
    if prompt_length - 1 + response_length > logits.shape[1]:
        raise ValueError(f"response_logits: logits cover {logits.shape[1]} positions, need "
                         f"{prompt_length - 1 + response_length} for P={prompt_length}, R={response_length}")
    return logits[:, prompt_length - 1: prompt_length - 1 + response_length]


def response_log_probs(resp_logits: Tensor, responses: Tensor, temperature: float,
                       calculate_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[b, R]`` of ``responses`` (and entropy ``[b, R]`` if asked) from aligned logits.

    ``resp_logits`` is ``[b, R, V]`` as returned by :func:`response_logits`. Both outputs are
    computed from ``logits / temperature`` (the distribution the sampler drew from).
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: log-probs need a positive sampling temperature "
                         "(use 1.0 for greedy/unscaled)")
    scaled = resp_logits.float()
    if temperature != 1.0:  # a pass over the logits saved at the usual T = 1
        scaled = scaled / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    log_probs = log_p.gather(-1, responses.long().unsqueeze(-1)).squeeze(-1)
    # exp(log p) underflows to exactly 0 where p does, so 0 * log p stays finite
    entropy = -(log_p.exp() * log_p).sum(-1) if calculate_entropy else None
    return log_probs, entropy
