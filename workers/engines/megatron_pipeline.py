"""A compact non-interleaved 1F1B pipeline schedule over torch.distributed point-to-point.

megatron-core's own schedules and p2p helpers assume CUDA (streams, the current CUDA device),
so this one uses only ``dist.batch_isend_irecv`` and runs on gloo (CPU) as well as NCCL.

Schedule of stage ``p`` of ``P`` with ``M`` micro-batches (Narayanan et al. 2021, "PipeDream-
Flush"): ``min(P - p - 1, M)`` warm-up forwards, then steady 1F1B (one forward, one backward), then
the remaining cool-down backwards. At most ``P - p`` activations are alive per stage. Paired
send/recv in the steady phase go in one ``batch_isend_irecv`` so neighbours never deadlock.
Every micro-batch's activation has a shape the caller states (all stages know the data shapes).

What differs from the textbook loop: each schedule is a generator (a ``Schedule``) that posts its
non-blocking p2p ops and yields their ``Work`` objects at every communication point, instead of
waiting on them itself. ``run_blocking`` drives one schedule by waiting on each yielded batch (the
plain schedule); megatron_fused.py drives two at once, running whichever has its inputs, so one
model's compute fills the other's pipeline bubbles (RLHFuse's intra-stage fusion).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist
from torch import Tensor

# forward_step(micro_index, input_hidden_or_None) -> hidden (non-last stage) or (loss, result) (last)
ForwardStep = Callable[[int, Tensor | None], Any]
# yields the works it waits on before it may go on; returns its result
Schedule = Generator[list, None, Any]


def no_work() -> Schedule:
    """A schedule with nothing to do (no micro-batch on any rank)."""
    return []
    yield  # unreachable: makes this a generator that finishes at once


_REVERSED_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def reversed_p2p_group() -> dist.ProcessGroup:
    """This rank's pipeline ranks again, as a process group of its own for a reversed engine's
    point-to-point: the actor (default group) and a reversed critic exchange messages between the
    same two ranks in both directions, and in a fused schedule their order interleaves by timing.
    One group per pipeline, made once per layout (new_group is collective over the world: every
    rank builds all of them, in the same order)."""
    from megatron.core import parallel_state as ps

    mine = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    key = tuple(sorted(set(every)))
    if key not in _REVERSED_GROUPS:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in key}
        _REVERSED_GROUPS[key] = groups[mine]
    return _REVERSED_GROUPS[key]


class StageLink:
    """Point-to-point with the previous/next pipeline stage (global ranks).

    ``group``: the process group the ops run in (None: the default world). A model whose pipeline
    runs in the other direction between the same ranks (a reversed critic, fused with the actor)
    uses a group of its own, so its messages never match the other model's. Every method is a
    generator: ``x = yield from link.recv_forward(shape)``."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        self.prev, self.next, self.dtype, self.device, self.group = prev_rank, next_rank, dtype, device, group

    def _run(self, sends: list[tuple[Tensor, int]], recv_shapes: list[tuple[tuple[int, ...], int]]):
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape, _ in recv_shapes]
        # ``ops`` holds the send tensors alive (contiguous() may copy) until the works complete
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b, (_, peer) in zip(bufs, recv_shapes)]
        if ops:
            yield dist.batch_isend_irecv(ops)
        return bufs

    def recv_forward(self, shape):
        if self.prev is None:
            return None
        (buf,) = yield from self._run([], [(shape, self.prev)])
        return buf.requires_grad_()

    def send_forward(self, hidden: Tensor):
        if self.next is not None:
            yield from self._run([(hidden.detach(), self.next)], [])

    def recv_backward(self, shape):
        if self.next is None:
            return None
        (buf,) = yield from self._run([], [(shape, self.next)])
        return buf

    def send_backward(self, grad: Tensor | None):
        if self.prev is not None:
            yield from self._run([(grad, self.prev)], [])

    def send_forward_recv_backward(self, hidden: Tensor, shape):
        if self.next is None:
            return None
        (buf,) = yield from self._run([(hidden.detach(), self.next)], [(shape, self.next)])
        return buf

    def send_backward_recv_forward(self, grad: Tensor | None, shape):
        if self.prev is None:
            return None
        (buf,) = yield from self._run([(grad, self.prev)], [(shape, self.prev)])
        return buf.requires_grad_()


class WaitClock:
    """Seconds this process spent waiting for pipeline messages (run_blocking and the fused
    driver add to it): where the bubbles are, for benchmarks."""
    total_s = 0.0


def run_blocking(schedule: Schedule) -> Any:
    """Drive one schedule alone: wait on every batch of works it yields; return its result."""
    try:
        works = next(schedule)
        while True:
            t0 = time.perf_counter()
            for work in works:
                work.wait()
            WaitClock.total_s += time.perf_counter() - t0
            works = schedule.send(None)
    except StopIteration as stop:
        return stop.value


def _backward(inp: Tensor | None, out: Any, grad: Tensor | None) -> Tensor | None:
    """Back-propagate one micro-batch; return the gradient for the previous stage's output."""
    if grad is None:  # last stage: ``out`` is the (already scaled) loss
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    return None if inp is None else inp.grad


def forward_only_schedule(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                          forward_step: ForwardStep) -> Schedule:
    results = []
    for i in range(num_micro):
        out = forward_step(i, (yield from link.recv_forward(shape_of(i))))
        if link.next is None:
            results.append(out)
        else:
            yield from link.send_forward(out)
    return results


def forward_only(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                 forward_step: ForwardStep) -> list[Any]:
    """Forward every micro-batch through the pipeline; the last stage returns their results."""
    return run_blocking(forward_only_schedule(link, num_micro, shape_of, forward_step))


def schedule_1f1b(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                  forward_step: ForwardStep, stage: int, num_stages: int) -> Schedule:
    """The 1F1B schedule as a generator (see ``forward_backward_1f1b``)."""
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
        out = run_forward(i, (yield from link.recv_forward(shape_of(i))))
        yield from link.send_forward(out)

    steady = num_micro - warmup
    inp = (yield from link.recv_forward(shape_of(warmup))) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        out = run_forward(i, inp)
        # the backward due now is micro-batch k's (the oldest alive one)
        grad = None if last else (yield from link.send_forward_recv_backward(out, shape_of(k)))
        old_inp, old_out = alive.pop(0)
        grad_in = _backward(old_inp, old_out, grad)
        if k == steady - 1:
            yield from link.send_backward(grad_in)
        else:
            inp = yield from link.send_backward_recv_forward(grad_in, shape_of(i + 1))

    for j in range(warmup):
        i = num_micro - warmup + j
        old_inp, old_out = alive.pop(0)
        grad = yield from link.recv_backward(shape_of(i))
        yield from link.send_backward(_backward(old_inp, old_out, grad))
    return results


def forward_backward_1f1b(link: StageLink, num_micro: int, shape_of: Callable[[int], tuple[int, ...]],
                          forward_step: ForwardStep, stage: int, num_stages: int) -> list[Any]:
    """Train-mode 1F1B. On the last stage ``forward_step`` returns ``(loss, result)``; the loss is
    back-propagated and the results (one per micro-batch) are returned. Other stages return []."""
    return run_blocking(schedule_1f1b(link, num_micro, shape_of, forward_step, stage, num_stages))
