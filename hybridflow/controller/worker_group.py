"""RayWorkerGroup: one Ray actor per resource-pool slot, driven as one object from the controller.

Every ``@register``-decorated method of the worker class becomes a group method:
dispatch (split the arguments) -> execute (on all ranks, or rank 0) -> collect (join results).
Every wait is bounded: a rank that raises, dies or hangs becomes one ``WorkerGroupError`` that
names the group, the rank and the method (with the remote traceback), within the group's timeout,
and the driver never hangs.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.dispatch import DispatchMode, Execute, registered_methods
from hybridflow.controller.future import DataProtoFuture, GroupFuture
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.ports import node_ip_and_free_port

DEFAULT_TIMEOUT_S = float(os.environ.get("HYBRIDFLOW_CALL_TIMEOUT_S", "1800"))
# Starting actors (new processes, imports) is slow on a loaded machine; it gets its own bound.
START_TIMEOUT_S = float(os.environ.get("HYBRIDFLOW_START_TIMEOUT_S", "300"))
# A worker's start-up call (verl's name for it: init_model builds the model, loads the weights and
# starts vLLM) is slow but healthy on a loaded machine, so it is bounded by the group's
# init_timeout_s (trainer.init_timeout_s) rather than by the per-step call bound.
STARTUP_METHODS = frozenset({"init_model"})


class WorkerGroupError(RuntimeError):
    """A rank of a worker group raised, died, or did not answer in time."""

    # (the actors' group name, rank) when the rank's process died: its last output is in that
    # rank's log file, where the run keeps one (hybridflow/run_logs.py)
    died: tuple[str, int] | None = None


class WorkerMemoryError(WorkerGroupError):
    """Ray's memory monitor killed a rank because the node ran out of host memory."""


def _first_line(err: BaseException) -> str:
    """Ray's errors run to dozens of lines (object-store stats, top processes); the first says what."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class RayClassWithInitArgs:
    """A worker class plus the arguments of its constructor, instantiated later on each slot."""

    def __init__(self, cls, *args, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs


@dataclass(frozen=True)
class MeshInfo:
    dp_ranks: list[int]
    dp_size: int
    collect: list[bool]


# Defined in a module that imports nothing heavy: a Ray task's worker imports the function's
# module, and this one here pulled in torch (measured: 3.3 s per worker group, now 0.2 s)
_node_ip_and_free_port = ray.remote(num_cpus=0)(node_ip_and_free_port)


def driver_on_only_node() -> bool:
    """Whether the Ray cluster has one live node and this driver runs on it (a local Ray, or a
    one-node cluster joined by address; not a Ray Client connection from elsewhere)."""
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - Ray Client has no local node: ask the node by a task
        return False
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    return alive == [here]


class RayWorkerGroup:
    def __init__(self, resource_pool: ResourcePool | None, ray_cls_with_init: RayClassWithInitArgs | None,
                 name_prefix: str = "wg", timeout_s: float | None = None, env: dict[str, str] | None = None,
                 _actors: list | None = None, _method_prefix: str = "", _worker_cls=None,
                 init_timeout_s: float | None = None):
        self.name = name_prefix
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self.init_timeout_s = init_timeout_s or self.timeout_s  # for STARTUP_METHODS
        self._prefix = _method_prefix
        self._mesh_cache: dict[str, MeshInfo] = {}
        if _actors is not None:  # a view on actors that already exist (colocated roles)
            self._actors, worker_cls = _actors, _worker_cls
        else:
            worker_cls = ray_cls_with_init.cls
            self._actors = self._create_actors(resource_pool, ray_cls_with_init, env or {})
        self._worker_cls = worker_cls
        self._specs: dict[str, dict] = {}
        for method, spec in registered_methods(worker_cls).items():
            if self._prefix:
                if not method.startswith(self._prefix):
                    continue
                method = method[len(self._prefix):]
            self._specs[method] = spec
            setattr(self, method, functools.partial(self._call, method, spec))

    # ------------------------------------------------------------ creation
    def _create_actors(self, pool: ResourcePool, cls_init: RayClassWithInitArgs, extra_env: dict) -> list:
        slots = pool.slots()
        world = len(slots)
        master_addr, master_port = self._rendezvous(slots[0])
        share = 1.0 / pool.max_colocate_count
        remote_cls = ray.remote(cls_init.cls)
        actors, local_counts = [], {}
        threads = max(1, int(pool.cpus_per_slot * share))
        for rank, slot in enumerate(slots):
            local_rank = local_counts.get(slot.node_rank, 0)
            local_counts[slot.node_rank] = local_rank + 1
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": master_addr,
                   "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local_rank),
                   "HYBRIDFLOW_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
                   "HYBRIDFLOW_GROUP": self.name, **extra_env}
            options = dict(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.pg, placement_group_bundle_index=slot.bundle_index),
                num_cpus=pool.cpus_per_slot * share,
                runtime_env={"env_vars": env},
                name=f"{self.name}_{rank}_{os.getpid()}_{id(self):x}",
            )
            if pool.use_gpu:
                options["num_gpus"] = share
            actors.append(remote_cls.options(**options).remote(*cls_init.args, **cls_init.kwargs))
        # Surface constructor failures now, with the rank that failed.
        self._pids = self._wait([a._hf_pid.remote() for a in actors], "__init__", timeout_s=START_TIMEOUT_S)
        return actors

    def _rendezvous(self, slot) -> tuple[str, int]:
        """Rank 0's node IP and a free port there for the group's TCPStore. Where the driver runs
        on the cluster's only node, rank 0 runs there too and the driver picks both itself: asking
        the node through a Ray task costs a Ray worker process's start (0.7 s on an idle 2-core
        machine, seconds on a busy one) before any rank can start."""
        if driver_on_only_node():
            return node_ip_and_free_port()
        first = PlacementGroupSchedulingStrategy(placement_group=slot.pg, placement_group_bundle_index=slot.bundle_index)
        return self._wait([_node_ip_and_free_port.options(scheduling_strategy=first).remote()],
                          "start", timeout_s=START_TIMEOUT_S)[0]

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        return list(self._actors)

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    def spawn(self, roles) -> dict[str, "RayWorkerGroup"]:
        """Views of a colocated group: one WorkerGroup per role, sharing the same actors."""
        views = {}
        for role in roles:
            view = RayWorkerGroup(None, None, name_prefix=f"{self.name}/{role}", timeout_s=self.timeout_s,
                                  init_timeout_s=self.init_timeout_s, _actors=self._actors,
                                  _method_prefix=f"{role}__", _worker_cls=self._worker_cls)
            view._pids = self._pids
            views[role] = view
        return views

    # ------------------------------------------------------------ meshes
    def mesh_info(self, name: str) -> MeshInfo:
        if name not in self._mesh_cache:
            method = self._prefix + "_hf_mesh"
            infos = self._wait([getattr(a, method).remote(name) for a in self._actors], "_hf_mesh")
            missing = [r for r, i in enumerate(infos) if i is None]
            if missing:
                raise WorkerGroupError(
                    f"{self.name}: ranks {missing} have not registered mesh {name!r}; call "
                    f"self.register_mesh({name!r}, dp_rank, dp_size, is_collect) in the worker before using "
                    f"Dispatch.mesh({name!r})")
            dp_size = infos[0].dp_size
            collect_of = {}
            for r, i in enumerate(infos):
                if i.is_collect:
                    if i.dp_rank in collect_of:
                        raise WorkerGroupError(f"{self.name}: mesh {name!r} has two collect ranks for dp rank "
                                               f"{i.dp_rank} (ranks {collect_of[i.dp_rank]} and {r})")
                    collect_of[i.dp_rank] = r
            if sorted(collect_of) != list(range(dp_size)):
                raise WorkerGroupError(f"{self.name}: mesh {name!r} needs one collect rank per dp rank 0..{dp_size - 1}, "
                                       f"got {sorted(collect_of)}")
            self._mesh_cache[name] = MeshInfo([i.dp_rank for i in infos], dp_size, [i.is_collect for i in infos])
        return self._mesh_cache[name]

    # ------------------------------------------------------------ calls
    def _call(self, method: str, spec: dict, *args, **kwargs):
        mode: DispatchMode = spec["dispatch_mode"]
        dispatched = mode.dispatch_fn(self, *args, **kwargs)
        calls, ctx = dispatched if isinstance(dispatched, tuple) else (dispatched, {})
        if len(calls) != self.world_size:
            raise WorkerGroupError(f"{self.name}.{method}: dispatch produced {len(calls)} calls for "
                                   f"{self.world_size} workers")
        name = self._prefix + method
        if spec["execute_mode"] is Execute.RANK_ZERO:
            a, kw = calls[0]
            refs = [getattr(self._actors[0], name).remote(*a, **kw)]
            collect = lambda outs: outs[0]  # noqa: E731
        else:
            refs = [getattr(actor, name).remote(*a, **kw) for actor, (a, kw) in zip(self._actors, calls)]
            collect = functools.partial(self._collect, mode, ctx)
        if spec["blocking"]:
            return collect(self._wait(refs, method, self.init_timeout_s if method in STARTUP_METHODS else None))
        if spec["execute_mode"] is Execute.ALL and "pad" in ctx:
            if mode.mesh_name is not None:
                info = self.mesh_info(mode.mesh_name)
                order = sorted((info.dp_ranks[r], r) for r in range(len(refs)) if info.collect[r])
                parts = [refs[r] for _, r in order]
            else:
                parts = list(refs)
            return DataProtoFuture(self, method, refs, collect, parts, ctx["pad"])
        return GroupFuture(self, method, refs, collect)

    def submit(self, method: str, *args, **kwargs) -> GroupFuture:
        """Start a group method without waiting: the call's future (``get()`` waits, bounded by the
        group's timeout, and collects as the blocking call would). A group whose processes are not
        another group's then works while the controller drives that other group (separate pools)."""
        if method not in self._specs:
            raise AttributeError(f"{self.name}: no group method {method!r} (registered: {sorted(self._specs)})")
        return self._call(method, {**self._specs[method], "blocking": False}, *args, **kwargs)

    def _collect(self, mode: DispatchMode, ctx: dict, outputs: list):
        return mode.collect_fn(self, outputs, **ctx)

    def execute_all_async(self, method: str, *args, **kwargs) -> list:
        """Call a method on every rank with the same arguments; returns the Ray refs."""
        return [getattr(a, self._prefix + method).remote(*args, **kwargs) for a in self._actors]

    def execute_all(self, method: str, *args, **kwargs) -> list:
        return self._wait(self.execute_all_async(method, *args, **kwargs), method)

    def take_spans(self, timeout_s: float | None = None) -> list[list[tuple[str, float, float]]]:
        """Each rank's stage spans since the last call, in rank order (controller/spans.py). Spans
        belong to processes: take them through one role's view of a colocated group, not each."""
        return self._wait([a._hf_take_spans.remote() for a in self._actors], "_hf_take_spans", timeout_s)

    def _wait(self, refs: list, method: str, timeout_s: float | None = None, ranks: list[int] | None = None) -> list:
        """Results in the order of ``refs``; fail fast on the first rank that raises or dies.

        ``refs`` are one per rank of the group unless ``ranks`` names the worker rank behind each
        ref (a call on a subset of the ranks): the errors name that rank, and the stop report
        prints that rank's log."""
        timeout_s = timeout_s or self.timeout_s
        labels = list(range(len(refs))) if ranks is None else list(ranks)
        if len(labels) != len(refs):
            raise ValueError(f"{len(refs)} refs but {len(labels)} ranks")
        index = {ref: i for i, ref in enumerate(refs)}
        results = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(labels[index[r]] for r in pending)
                knob = ("trainer.init_timeout_s" if method in STARTUP_METHODS
                        else "HYBRIDFLOW_CALL_TIMEOUT_S / trainer.call_timeout_s")
                raise WorkerGroupError(
                    f"{self.name}: {method} did not finish within {timeout_s:g}s on ranks {late} "
                    f"(raise the timeout with {knob} if the work is legitimately long)")
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                i = index[ref]
                rank = labels[i]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.OutOfMemoryError as e:  # Ray's memory monitor killed the worker
                    raise WorkerMemoryError(f"{self.name}: rank {rank} was killed for lack of host memory during "
                                            f"{method} ({_first_line(e)})") from None
                except ray.exceptions.RayTaskError as e:
                    raise WorkerGroupError(f"{self.name}: rank {rank} raised in {method}:\n{e}") from None
                except ray.exceptions.RayActorError as e:
                    died = WorkerGroupError(f"{self.name}: rank {rank} died during {method} ({_first_line(e)})")
                    died.died = (self.name.split("/")[0], rank)  # a role's view is named "<group>/<role>"
                    raise died from None
        return results

    def shutdown(self) -> None:
        for a in self._actors:
            ray.kill(a, no_restart=True)
