"""Log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each TP rank holds logits ``z[..., V/tp]`` for its slice of the vocabulary. Only ``[...]``-shaped
partial sums cross ranks, so memory stays ``O(V/tp)`` per token.
"""
from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor


def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """Entropy ``H = log S - sum_v exp(z_v - m) z'_v / S`` with ``z' = z - m``, ``S = sum_v exp(z'_v)``.

    ``m`` is the global max (all-reduce MAX; a constant shift, so no gradient flows through it).
    ``S`` and the weighted sum are all-reduced with megatron's reduce_from_tensor_model_parallel_region
    (forward all-reduce, backward identity): correct because everything downstream of the sums is
    computed identically on every TP rank.
    """
    z = logits.float()
    m = z.detach().amax(dim=-1)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1))
    return total.log() - weighted / total


def vocab_parallel_response_outputs(logits: Tensor, labels: Tensor, temperature: float,
                                    calculate_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of ``labels`` under ``softmax(logits / temperature)``.

    With one TP rank the engine uses workers/engines/logprob.py's fused path instead."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: log-probs need a positive sampling temperature "
                         "(use 1.0 for unscaled)")
    scaled = logits.float() / temperature  # a new tensor, which megatron's kernel may overwrite:
    # it subtracts the max in place. Entropy first: its autograd keeps its own tensors, not ``scaled``
    entropy = vocab_parallel_entropy(scaled) if calculate_entropy else None
    return -vocab_parallel_cross_entropy(scaled, labels), entropy
