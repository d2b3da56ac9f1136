"""A compact non-interleaved 1F1B pipeline schedule over torch.distributed point-to-point.

megatron-core's own schedules and p2p helpers assume CUDA (streams, the current CUDA device),
so this one uses only ``dist.batch_isend_irecv`` and runs on gloo (CPU) as well as NCCL.

Schedule of stage ``p`` of ``P`` with ``M`` micro-batches (Narayanan et al. 2021, "PipeDream-
Flush"): ``min(P - p - 1, M)`` warm-up forwards, then steady 1F1B (one forward, one backward), then
the remaining cool-down backwards. At most ``P - p`` activations are alive per stage. Paired
send/recv in the steady phase go in one ``batch_isend_irecv`` so neighbours never deadlock.
Every micro-batch's activation has a shape the caller states (all stages know the data shapes).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

# forward_step(micro_index, input_hidden_or_None) -> hidden (non-last stage) or (loss, result) (last)
ForwardStep = Callable[[int, Tensor | None], Any]


class StageLink:
    """Point-to-point with the previous/next pipeline stage (global ranks from parallel_state)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, dtype: torch.dtype, device: torch.device):
        self.prev, self.next, self.dtype, self.device = prev_rank, next_rank, dtype, device

    def _run(self, sends: list[tuple[Tensor, int]], recv_shapes: list[tuple[tuple[int, ...], int]]) -> list[Tensor]:
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape, _ in recv_shapes]
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, b, peer) for b, (_, peer) in zip(bufs, recv_shapes)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return bufs

    def recv_forward(self, shape) -> Tensor | None:
        if self.prev is None:
            return None
        return self._run([], [(shape, self.prev)])[0].requires_grad_()

    def send_forward(self, hidden: Tensor) -> None:
        if self.next is not None:
            self._run([(hidden.detach(), self.next)], [])

    def recv_backward(self, shape) -> Tensor | None:
        return None if self.next is None else self._run([], [(shape, self.next)])[0]

    def send_backward(self, grad: Tensor | None) -> None:
        if self.prev is not None:
            self._run([(grad, self.prev)], [])

    def send_forward_recv_backward(self, hidden: Tensor, shape) -> Tensor | None:
        if self.next is None:
            return None
        return self._run([(hidden.detach(), self.next)], [(shape, self.next)])[0]

    def send_backward_recv_forward(self, grad: Tensor | None, shape) -> Tensor | None:
        if self.prev is None:
            return None
        return self._run([(grad, self.prev)], [(shape, self.prev)])[0].requires_grad_()


def _backward(inp: Tensor | None, out: Any, grad: Tensor | None) -> Tensor | None:
    """Back-propagate one micro-batch; return the gradient for the previous stage's output."""
    if grad is None:  # last stage: ``out`` is the (already scaled) loss
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    return None if inp is None else inp.grad


def forward_only(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                 forward_step: ForwardStep) -> list[Any]:
    """Forward every micro-batch through the pipeline; the last stage returns their results."""
    results = []
    for i in range(num_micro):
        out = forward_step(i, link.recv_forward(shape_of(i)))
        if link.next is None:
            results.append(out)
        else:
            link.send_forward(out)
    return results


def forward_backward_1f1b(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                          forward_step: ForwardStep, stage: int, num_stages: int) -> list[Any]:
    """Train-mode 1F1B. On the last stage ``forward_step`` returns ``(loss, result)``; the loss is
    back-propagated and the results (one per micro-batch) are returned. Other stages return []."""
    last = link.next is None
    warmup = min(num_stages - stage - 1, num_micro)
    alive: list[tuple[Tensor | None, Any]] = []  # (input, output) of forwards awaiting backward
    results: list[Any] = []

    def run_forward(i: int, inp: Tensor | None):
        out = forward_step(i, inp)
        if last:
            loss, result = out
            results.append(result)
            out = loss
        alive.append((inp, out))
        return out

    for i in range(warmup):
        link.send_forward(run_forward(i, link.recv_forward(shape_of(i))))

    steady = num_micro - warmup
    inp = link.recv_forward(shape_of(warmup)) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        out = run_forward(i, inp)
        # the backward due now is micro-batch k's (the oldest alive one)
        grad = None if last else link.send_forward_recv_backward(out, shape_of(k))
        old_inp, old_out = alive.pop(0)
        grad_in = _backward(old_inp, old_out, grad)
        if k == steady - 1:
            link.send_backward(grad_in)
        else:
            inp = link.send_backward_recv_forward(grad_in, shape_of(i + 1))

    for j in range(warmup):
        i = num_micro - warmup + j
        old_inp, old_out = alive.pop(0)
        grad = link.recv_backward(shape_of(i))
        link.send_backward(_backward(old_inp, old_out, grad))
    return results
