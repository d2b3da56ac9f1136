"""RLHFuse's intra-stage fusion (Zhong et al. 2024, arXiv 2409.13221, sec. 5): PPO's actor and critic
updates as one pipeline schedule that fills each other's bubbles.

The critic engine is built with ``reverse_pipeline=True`` (critic stage ``s`` on pipeline rank
``P-1-s``), so each rank holds actor stage ``p`` and critic stage ``P-1-p``: the actor's
micro-batches flow rank 0 -> P-1 while the critic's flow P-1 -> 0. Where one model's 1F1B waits for
an activation or gradient from a neighbour, the rank computes the other model's ready micro-batch;
in particular each model's warm-up and cool-down bubble (rank ``p`` idles ``P-1-p`` forward slots
at the start of its 1F1B) is where the other model starts or ends.

What differs from the paper: RLHFuse searches a fused schedule offline (simulated annealing over
the micro-batch order) and runs it statically. Here each model runs its own unchanged 1F1B
(megatron_pipeline.schedule_1f1b, a generator that yields its pending p2p works) and a small
driver on each rank runs whichever schedule has its inputs, preferring the model the rank feeds
first. The numbers equal the two updates one after the other: every model keeps its micro-batch
split, loss scaling and order of gradient accumulation; only the order between the two models'
computations changes, and their gradients, reductions, clipping and optimizer steps are separate.
The two models' messages between the same two ranks cannot be confused: the reversed critic's
point-to-point runs in a process group of its own (megatron_pipeline.reversed_p2p_group).
"""
from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from workers.engines.megatron_pipeline import Schedule, WaitClock

_TP_POLL_S = 50e-6  # TP > 1: a schedule ready on this rank but not on a TP peer yet
DEFAULT_TIMEOUT_S = 600.0  # no progress at all for this long: a peer died (init_distributed's bound)


def check_fusable(actor, critic) -> None:
    """Raise ValueError unless ``actor`` and ``critic`` are Megatron engines whose schedules can fuse."""
    from workers.engines.megatron import MegatronEngine

    if not (isinstance(actor, MegatronEngine) and isinstance(critic, MegatronEngine)):
        raise ValueError("the fused actor-critic update needs strategy='megatron' for both the actor and the critic "
                         f"(got {type(actor).__name__} and {type(critic).__name__})")
    if (actor.tp, actor.pp) != (critic.tp, critic.pp) or actor.pp < 2:
        raise ValueError(f"the fused actor-critic update needs the same tp and pp >= 2 for actor and critic (actor "
                         f"tp={actor.tp} pp={actor.pp}, critic tp={critic.tp} pp={critic.pp}); with pp=1 there is "
                         "no pipeline bubble to fill: call update_critic and update_actor")
    if actor.reversed or not critic.reversed:
        raise ValueError("the fused actor-critic update needs the critic's pipeline reversed against the actor's: "
                         "the recipe builds it so with stage_fusion.fuse_actor_critic_update=true "
                         "(EngineConfig reverse_pipeline=true on the critic's engine only)")
    if actor.dp_rank != critic.dp_rank:
        raise ValueError("actor and critic disagree on this rank's data-parallel rank; they must share one layout")


def fused_train_batch(actor_engine, actor_data, actor_loss_fn, critic_engine, critic_data, critic_loss_fn,
                      actor_skip_rows=None, prefer: str = "feed", timeout_s: float = DEFAULT_TIMEOUT_S
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """One optimizer step of the actor on ``actor_data`` and one of the critic on ``critic_data``
    (this rank's shares of their mini-batches), with both 1F1B schedules interleaved. Returns
    ``(actor_metrics, critic_metrics)``, each what ``MegatronEngine.train_batch`` returns;
    ``actor_skip_rows`` is the actor's ``skip_rows``. ``prefer``: which ready model runs first
    ("feed": the one whose earlier stage this rank holds; "actor"; "critic")."""
    check_fusable(actor_engine, critic_engine)
    actor_step = actor_engine.begin_step(actor_data, actor_loss_fn, actor_skip_rows)
    critic_step = critic_engine.begin_step(critic_data, critic_loss_fn)
    order = _preference(prefer, actor_engine, critic_engine)
    with ExitStack() as on_device:
        on_device.enter_context(actor_engine.memory.params_on_device())
        on_device.enter_context(critic_engine.memory.params_on_device())
        schedules = [actor_step.schedule, critic_step.schedule]
        results = drive([schedules[i] for i in order], timeout_s, actor_engine.device)
        actor_results, critic_results = (results[order.index(0)], results[order.index(1)])
        # same collective order on every rank: the actor's reduction, then the critic's
        actor_norm = actor_engine.apply_gradients()
        critic_norm = critic_engine.apply_gradients()
    return (actor_engine.finish_step(actor_step, actor_results, actor_norm),
            critic_engine.finish_step(critic_step, critic_results, critic_norm))


def _preference(prefer: str, actor, critic) -> list[int]:
    """Index order (0 actor, 1 critic) in which ready schedules are run on this rank."""
    if prefer == "actor":
        return [0, 1]
    if prefer == "critic":
        return [1, 0]
    if prefer != "feed":
        raise ValueError(f"prefer={prefer!r}: use 'feed', 'actor' or 'critic'")
    # the model this rank holds an earlier stage of has more ranks waiting downstream for it
    return [0, 1] if actor.stage <= critic.stage else [1, 0]


class _Running:
    """One schedule and the works it waits on. On gloo a helper thread waits on them
    (``Work.wait`` releases the GIL): gloo's point-to-point works report ``is_completed()`` only
    once waited on, and a second wait would wait for another message. On NCCL ``is_completed``
    polls the op's event, and the wait in this thread orders its stream after the op."""

    def __init__(self, schedule: Schedule, waiter: ThreadPoolExecutor | None):
        self.schedule, self.waiter = schedule, waiter
        self.works, self.pending, self.done, self.result = [], None, False, None

    def ready(self) -> bool:
        if self.done:
            return False
        if self.waiter is not None:
            return self.pending is None or self.pending.done()
        return all(w.is_completed() for w in self.works)

    def advance(self) -> None:
        """Run the schedule to its next communication point (or its end)."""
        if self.pending is not None:
            self.pending.result()  # raises a failed op's error
        elif self.waiter is None:
            _wait_all(self.works)
        try:
            self.works = self.schedule.send(None)
        except StopIteration as stop:
            self.done, self.works, self.result = True, [], stop.value
        self.pending = self.waiter.submit(_wait_all, self.works) if self.works and self.waiter else None


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


def drive(schedules: list[Schedule], timeout_s: float = DEFAULT_TIMEOUT_S, device=None) -> list[Any]:
    """Run several schedules on this rank to completion, interleaved; return their results.

    Each step runs the first schedule (in the given order) whose pending works have all
    completed; when none has, it sleeps until one completes. It never blocks on one schedule's
    works alone: while it waited, the other schedule's peer might wait for this rank, and both
    ranks would stall. With TP > 1 the TP peers of a rank must run the same model's computation at
    the same time (their forwards all-reduce together), so they agree on which schedules are ready
    (one all-reduce per decision).
    """
    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    gloo = dist.get_backend() == "gloo"
    with ThreadPoolExecutor(max_workers=len(schedules), thread_name_prefix="fused-p2p") as waiter:
        running = [_Running(s, waiter if gloo else None) for s in schedules]
        while not all(r.done for r in running):
            ready = [r.ready() for r in running]
            if tp_group is not None:
                flags = torch.tensor([int(x) for x in ready], dtype=torch.int32, device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=tp_group)
                if not any(flags.tolist()) and any(ready):
                    time.sleep(_TP_POLL_S)  # ready here, not yet on a TP peer
                ready = [bool(x) for x in flags.tolist()]
            chosen = next((r for r, ok in zip(running, ready) if ok), None)
            if chosen is not None:
                chosen.advance()
                continue
            pending = [r.pending for r in running if not r.done and r.pending is not None and not r.pending.done()]
            if not gloo:
                time.sleep(_TP_POLL_S)  # NCCL: polled events; sleep briefly instead of spinning
            elif pending:
                t0 = time.perf_counter()
                finished, _ = futures.wait(pending, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)
                WaitClock.total_s += time.perf_counter() - t0
                if not finished:
                    raise TimeoutError(f"fused pipeline schedule: no message arrived for {timeout_s:.0f}s; a "
                                       "pipeline peer is gone or the two schedules' messages are mismatched")
    return [r.result for r in running]
