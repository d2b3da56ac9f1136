"""``trainer.n_gpus_per_node: auto``: how many workers a node runs, decided before Ray starts.

On a GPU node: one worker per GPU (``device_count()``), verl's usual setting.

On a CPU host the cores can be spent two ways, and which is faster depends on the CPU, the model
and the batch, so it is predicted rather than assumed:
- replicated: one worker per ``cpus_per_worker`` cores (DDP via ``fsdp_size=auto``), each with a
  copy of the model and of vLLM, a gradient all-reduce over gloo per optimizer step, and each
  worker's matmuls on its own cores;
- one worker with every core: no all-reduce, one vLLM, bigger matmuls per forward, but OpenMP's
  barriers across threads and the python/vLLM per-step overhead paid once rather than in parallel.
Measured on the e2e bench's medium shape (docs/benchmarks.md, 2 cores): one 2-thread worker took
2.91 s per step against 3.48 s for two 1-thread workers in fp32 (AVX2 kernels).

The prediction is the placement planner's (hybridflow/placement): the machine's slot calibrated at
each candidate's thread count (``calibrate.py``, measured once and cached), then the fastest
colocated plan on that many slots. Ties go to one worker (one copy of everything). The choice and
both predictions are said once on stderr, as ``fsdp_size=auto`` does; an explicit
``n_gpus_per_node`` is never changed.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from hybridflow.errors import ConfigError

AUTO = "auto"
TIE = 0.02  # relative: predictions closer than this pick one worker (less memory, one vLLM)


def host_cores(num_cpus: int | None) -> int:
    """The cores the local Ray gets: ``ray_init.num_cpus``, else those this process may run on."""
    if num_cpus:
        return int(num_cpus)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def candidates(cores: int, cpus_per_worker: float) -> list[tuple[int, int]]:
    """(workers, threads each): replicated workers of ``cpus_per_worker`` cores, then one worker with
    every core; only the latter when the cores hold a single replica."""
    threads = max(1, int(cpus_per_worker + 1e-9))
    replicas = max(1, int(cores / cpus_per_worker + 1e-9))
    single = (1, max(1, cores))
    return [single] if replicas == 1 else [(replicas, threads), single]


def choose(predicted: dict[tuple[int, int], float]) -> tuple[tuple[int, int], str]:
    """The fastest predicted (workers, threads) and the reason, one clause; ties favour one worker."""
    best = min(predicted, key=lambda c: (predicted[c], c[0]))
    single = next((c for c in predicted if c[0] == 1), None)
    if single is not None and predicted[single] <= predicted[best] * (1 + TIE):
        best = single
    others = ", ".join(f"{_name(c)} {predicted[c]:.2f} s" for c in predicted if c != best)
    return best, f"predicted {predicted[best]:.2f} s/step against {others}" if others else "the only layout"


def _name(c: tuple[int, int]) -> str:
    return f"{c[0]} worker{'s' if c[0] > 1 else ''} x {c[1]} thread{'s' if c[1] > 1 else ''}"


def resolve(trainer, cores: int, joining: bool, on_gpu: Callable[[], bool], gpu_count: Callable[[], int],
            predict: Callable[[int, int], float], say: Callable[[str], None]) -> None:
    """Set ``trainer.n_gpus_per_node`` (and on CPU ``cpus_per_worker``) in place when it is ``auto``.
    ``cores``: the local Ray's; ``joining``: ray_init.address is set (a cluster not sized here);
    ``predict(workers, threads)``: the predicted step time of that layout on this host."""
    if trainer.n_gpus_per_node != AUTO:
        return
    if joining:
        raise ConfigError("trainer.n_gpus_per_node=auto sizes this machine, but ray_init.address joins a "
                          "cluster whose nodes are not known here: set trainer.n_gpus_per_node explicitly")
    if on_gpu():
        trainer.n_gpus_per_node = max(1, gpu_count())
        say(f"n_gpus_per_node=auto -> {trainer.n_gpus_per_node}: one worker per GPU of this node.")
        return
    layouts = candidates(cores, trainer.cpus_per_worker)
    if len(layouts) == 1:
        (workers, threads), why = layouts[0], f"{cores} core(s) hold one worker of cpus_per_worker=" \
                                              f"{trainer.cpus_per_worker:g}"
    else:
        (workers, threads), why = choose({c: predict(*c) for c in layouts})
    trainer.n_gpus_per_node, trainer.cpus_per_worker = workers, float(threads)
    say(f"n_gpus_per_node=auto -> {_name((workers, threads))} (n_gpus_per_node={workers}, cpus_per_worker="
        f"{threads}): {why}. Set trainer.n_gpus_per_node (and cpus_per_worker) explicitly to choose.")
