"""The 1F1B schedule on 3 real gloo stages: gradients equal a single-process run, the activation
memory bound of 1F1B holds, and micro-batches of different sizes pass through."""
from __future__ import annotations

import pickle

import pytest
import torch

from tests.distributed import run_distributed

STAGES, SIZES, WIDTH = 3, [3, 3, 3, 1, 2], 8  # 5 micro-batches, the last two smaller


def _stages():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(STAGES)]


def _micro_inputs():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, WIDTH, generator=gen) for n in SIZES]


def _stage_worker(rank, world):
    from workers.engines.megatron_pipeline import StageLink, forward_backward_1f1b, forward_only

    stage = _stages()[rank]
    inputs = _micro_inputs()
    link = StageLink(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None,
                     torch.float32, torch.device("cpu"))
    alive, peak = [0], [0]

    def step(i, hidden):
        x = stage(inputs[i] if hidden is None else hidden)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        if link.next is not None:
            return x
        return (x ** 2).sum() / sum(SIZES), float((x ** 2).sum().detach())

    def shape_of(i):
        return (SIZES[i], WIDTH)

    # count an activation as released when its backward ran: wrap the module's backward hook
    stage.register_full_backward_hook(lambda *_: alive.__setitem__(0, alive[0] - 1))
    results = forward_backward_1f1b(link, len(SIZES), shape_of, step, rank, world)
    grads = [p.grad.clone() for p in stage.parameters()]
    with torch.no_grad():
        outs = forward_only(link, len(SIZES), shape_of, lambda i, h: stage(inputs[i] if h is None else h))
    # pickled bytes: tensors sent through the queue as shared memory die with the worker
    return pickle.dumps((grads, results, peak[0], [o.sum().item() for o in outs]))


@pytest.mark.slow
def test_1f1b_gradients_match_single_process():
    got = [pickle.loads(r) for r in run_distributed(_stage_worker, STAGES, timeout_s=120)]
    stages = _stages()
    total, losses = 0.0, []
    for x in _micro_inputs():
        for s in stages:
            x = s(x)
        losses.append(float((x ** 2).sum()))
        total = total + (x ** 2).sum() / sum(SIZES)
    total.backward()
    for rank, (grads, results, peak, _) in enumerate(got):
        for g, p in zip(grads, stages[rank].parameters()):
            assert torch.allclose(g, p.grad, atol=1e-6), rank
        # 1F1B keeps at most (stages - rank) micro-batches' activations alive on stage ``rank``
        assert peak == min(STAGES - rank, len(SIZES)), (rank, peak)
    assert got[-1][1] == pytest.approx(losses)
    assert got[0][1] == [] and got[-1][3] != []
