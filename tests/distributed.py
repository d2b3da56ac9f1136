"""Run a function on N real processes joined in one gloo world (for engine/rollout/reshard tests).

Ray-free on purpose: these tests check SPMD numerics; the controller tests cover Ray.

The ranks are forked from multiprocessing's fork server, which imports torch, transformers,
megatron-core and vLLM once per test session (``PRELOAD``): spawned ranks imported them afresh in
every rank of every test, 8-12 s of CPU each, and that was most of these tests' time (the files
that use this took 681 s of the suite; 316 s forked). Each rank gets the caller's environment as
it is at the call; a variable that only takes effect at one of those imports (HYBRIDFLOW_CPU_ISA,
ATEN_CPU_CAPABILITY) keeps the value it had when the server started, the session's.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_lib
import time
import traceback

import torch.multiprocessing as mp

from hybridflow.ports import free_rendezvous_port


def free_port() -> int:
    return free_rendezvous_port("127.0.0.1")


def _entry(rank, world, port, fn, args, queue, environ):
    os.environ.clear()  # the caller's environment at the call, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import torch
        torch.set_num_threads(1)
        from hybridflow.device import init_distributed
        init_distributed(timeout_s=120)
        # pickled here: tensors sent through a multiprocessing queue share memory with a process
        # that exits right after, which breaks the transfer (ConnectionResetError in the parent)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))


PRELOAD = ["torch", "tensordict", "transformers", "megatron.core", "vllm"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked processes; return results by rank.

    ``fn`` must be importable (module level) and its return value picklable.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_lib.Empty:
                # a child killed by a signal (e.g. SIGILL) never reports: notice it, don't wait forever
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"rank {dead[0][0]} died with exit code {dead[0][1]}")
                elif time.monotonic() > deadline:
                    errors.append(f"no result within {timeout_s:g}s")
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
