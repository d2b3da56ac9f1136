"""The controller with real Ray actors: dispatch modes, collectives, colocation, futures, failures."""
import os
import time

import pytest
import torch

from hybridflow.controller import (Dispatch, DispatchMode, Execute, RayClassWithInitArgs, RayWorkerGroup,
                                   ResourceError, ResourcePool, Worker, WorkerGroupError, WorkerMemoryError,
                                   create_colocated_worker_cls, register)
from hybridflow.protocol import DP_PADDING_ROWS, DataProto

pytestmark = pytest.mark.slow


def rows(n, offset=0):
    return DataProto.from_dict({"x": torch.arange(offset, offset + n).unsqueeze(1).float()},
                               {"tag": [f"r{i}" for i in range(offset, offset + n)]})


def _gather_all(group, *args, **kwargs):
    return [((list(range(group.world_size)),), {})] * group.world_size


def _sum_collect(group, outputs):
    return sum(outputs)


class EchoWorker(Worker):
    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def who(self, tag):
        return (self.rank, self.world_size, tag, os.getpid())

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, a, b):
        return a + b + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto):
        y = data.batch["x"] * 2 * self.scale
        out = DataProto.from_dict({"x": y, "y": y, "rank": torch.full((len(data),), self.rank)},
                                  {"tag": data.non_tensor_batch["tag"]})
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def samples(self, data: DataProto, n: int):
        """n output rows per input row, adjacent (like generation with n samples per prompt)."""
        return data.repeat(n, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def padding_seen(self, data: DataProto):
        """Each row: the padding marker this rank's part carried (0: none), echoed with its meta."""
        seen = data.meta_info.get(DP_PADDING_ROWS, 0)
        return DataProto.from_dict({"seen": torch.full((len(data),), seen)}, meta_info=dict(data.meta_info))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto):
        return self.double.__wrapped__(self, data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce(self):
        import torch.distributed as dist
        self.init_distributed(timeout_s=60)
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return (dist.get_backend(), float(t))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def boom(self):
        if self.rank == 1:
            raise ValueError("bad sample 17")
        return "ok"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, seconds):  # a slow start-up (loading weights on a busy machine)
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=DispatchMode(_gather_all, _sum_collect))  # a user's own dispatch pair
    def count(self, ranks):
        return len(ranks) * (self.rank + 1)


class MeshWorker(Worker):
    """2 ranks as one TP group (tp=2, dp=1): both get the same data, rank 0 is collected."""

    def __init__(self, tp):
        super().__init__()
        self.register_mesh("train", dp_rank=self.rank // tp, dp_size=self.world_size // tp,
                           is_collect=self.rank % tp == 0)

    @register(dispatch_mode=Dispatch.mesh("train"))
    def forward(self, data: DataProto):
        return DataProto.from_dict({"y": data.batch["x"] + 100 * self.rank}, {"tag": data.non_tensor_batch["tag"]})

    @register(dispatch_mode=Dispatch.mesh("train"), blocking=False)
    def forward_async(self, data: DataProto):
        return self.forward.__wrapped__(self, data)


_POOLS = []


def make_group(cls, n=2, *args, name="g", timeout_s=None, **kwargs):
    pool = ResourcePool([n], cpus_per_slot=0.5, ready_timeout_s=60)
    _POOLS.append(pool)
    return RayWorkerGroup(pool, RayClassWithInitArgs(cls, *args, **kwargs), name_prefix=name, timeout_s=timeout_s)


@pytest.fixture(autouse=True)
def release_pools():
    yield
    while _POOLS:
        _POOLS.pop().release()


def _shared_group(cls, *args, name):
    """A module's group of 2 workers for the tests that only call it: a group's start (a Ray
    worker process importing torch and tensordict) is 3.5 s of a 4 s test on 2 cores."""
    pool = ResourcePool([2], cpus_per_slot=0.5, ready_timeout_s=60)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls, *args), name_prefix=name)
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def mesh(ray_cluster):
    """One TP group of 2 MeshWorkers (tp 2, dp 1)."""
    yield from _shared_group(MeshWorker, 2, name="mesh")


@pytest.fixture(scope="module")
def echo(ray_cluster):
    """One group of 2 EchoWorkers (scale 3)."""
    yield from _shared_group(EchoWorker, 3.0, name="echo")


def test_one_to_all_all_to_all_rank_zero(echo):
    g = echo
    got = g.who("hi")
    assert [(r, w, t) for r, w, t, _ in got] == [(0, 2, "hi"), (1, 2, "hi")]
    assert g.add([1, 10], [2, 20]) == [3, 31]
    assert g.only_zero() == 0
    with pytest.raises(ValueError, match="list of 2 items"):
        g.add(1, 2)


@pytest.mark.parametrize("n", [5, 7, 1])
def test_dp_compute_proto_uneven(echo, n):
    out = echo.double(rows(n))
    assert len(out) == n
    assert torch.equal(out.batch["y"].squeeze(1), torch.arange(n).float() * 6)
    assert list(out.non_tensor_batch["tag"]) == [f"r{i}" for i in range(n)]
    # first ceil(n/2) rows went to rank 0
    assert out.batch["rank"].tolist() == [0] * ((n + 1) // 2) + [1] * (n // 2)


def test_padding_is_stripped_from_outputs_with_several_rows_per_input(echo):
    out = echo.samples(rows(3), 2)  # padded to 4 rows on 2 workers -> 8 outputs, 2 of them padding
    assert out.batch["x"].squeeze(1).tolist() == [0, 0, 1, 1, 2, 2]
    assert list(out.non_tensor_batch["tag"]) == ["r0", "r0", "r1", "r1", "r2", "r2"]


def test_every_part_of_a_padded_split_is_marked_and_the_result_is_not(echo):
    """A training method must refuse padded parts on every rank alike (the engines' train_batch
    does), so all parts carry the marker; the collected result, padding stripped, does not."""
    padded, even = echo.padding_seen(rows(3)), echo.padding_seen(rows(4))
    assert padded.batch["seen"].tolist() == [1, 1, 1] and even.batch["seen"].tolist() == [0] * 4
    assert DP_PADDING_ROWS not in padded.meta_info


def test_mesh_dispatch_replicates_within_tp_and_collects_once(mesh):
    out = mesh.forward(rows(3))
    # dp_size 1: both ranks got all 3 rows; only rank 0's output is collected (no +100)
    assert torch.equal(out.batch["y"].squeeze(1), torch.arange(3).float())


def test_mesh_dispatch_dp2(ray_cluster):
    g = make_group(MeshWorker, 2, 1, name="mesh_dp")
    out = g.forward(rows(5))
    assert out.batch["y"].squeeze(1).tolist() == [0, 1, 2, 103, 104]
    g.shutdown()


def test_gloo_allreduce_across_actors(echo):
    assert echo.allreduce() == [("gloo", 3.0), ("gloo", 3.0)]


def test_rendezvous_by_the_driver_on_one_node_and_by_a_task_on_rank_0s_node_elsewhere(ray_cluster, monkeypatch):
    from hybridflow.controller import worker_group

    # the test cluster is local: the driver picks rank 0's address itself (the test above forms
    # its world that way); on a cluster of several nodes a Ray task on rank 0's node picks it
    assert worker_group.driver_on_only_node()
    monkeypatch.setattr(worker_group, "driver_on_only_node", lambda: False)
    g = make_group(EchoWorker, name="rdv")
    assert g.allreduce() == [("gloo", 3.0), ("gloo", 3.0)]
    g.shutdown()


def test_colocated_roles_share_one_process(ray_cluster):
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(EchoWorker, 1.0),
                                       "critic": RayClassWithInitArgs(EchoWorker, 10.0)})
    pool = ResourcePool([2])
    _POOLS.append(pool)
    g = RayWorkerGroup(pool, cls, name_prefix="colo")
    views = g.spawn(["actor", "critic"])
    a, c = views["actor"].who("a"), views["critic"].who("c")
    assert [x[3] for x in a] == [x[3] for x in c] == g.pids  # same processes
    assert torch.equal(views["critic"].double(rows(4)).batch["y"], views["actor"].double(rows(4)).batch["y"] * 10)
    g.shutdown()


def test_non_blocking_chain_without_driver_fetch(echo, mesh):
    fut = echo.double_async(rows(5))  # x 6
    direct = echo.double_async(fut)  # dp 2: the same split, each rank takes its own part
    data = direct.get()
    assert data.batch["y"].squeeze(1).tolist() == [0, 36, 72, 108, 144]
    # re-split into another dp size (the mesh group's dp 1): each worker fetches the parts itself
    out = mesh.forward(echo.double_async(rows(5)))
    assert out.batch["y"].squeeze(1).tolist() == [0, 6, 12, 18, 24]
    assert list(out.non_tensor_batch["tag"]) == [f"r{i}" for i in range(5)]


def test_submit_runs_a_group_while_the_controller_drives_another(echo):
    """Separate pools work at once: a submitted call runs while another group's blocking call
    does, and its future collects what the blocking call would."""
    main, side = make_group(EchoWorker, 1, name="main"), echo
    assert side.submit("double", rows(5)).get().batch["y"].squeeze(1).tolist() == side.double(rows(5)).batch[
        "y"].squeeze(1).tolist() == [0, 6, 12, 18, 24]
    t0 = time.monotonic()
    pending = side.submit("sleep", 3.0)
    assert main.sleep(3.0) == [0] and pending.get() == [0, 1]
    assert time.monotonic() - t0 < 5.0  # one after the other: 6 s; 2 s for Ray's calls on a busy machine
    with pytest.raises(AttributeError, match=r"echo: no group method 'nap'"):
        side.submit("nap", 1)
    main.shutdown()


def test_custom_dispatch_pair(echo):
    assert echo.count() == 2 * 1 + 2 * 2


def test_worker_raise_names_group_rank_method_and_traceback(echo):
    with pytest.raises(WorkerGroupError, match=r"echo: rank 1 raised in boom") as err:
        echo.boom()
    # the remote traceback: the failing line of the worker's method and the exception
    assert 'test_worker_group.py", line' in str(err.value) and "ValueError: bad sample 17" in str(err.value)
    assert echo.only_zero() == 0  # a method that raised leaves the group usable


def test_waiting_on_some_ranks_names_the_rank_that_raised(echo):
    """A call on a subset of the ranks (a stream replica, the fused rollout's local inference)
    names the worker's rank, not its place in the list: the stop report prints that rank's log."""
    refs = echo.execute_all_async("boom")
    assert echo._wait(refs[:1], "boom", ranks=[0]) == ["ok"]
    with pytest.raises(WorkerGroupError, match=r"echo: rank 1 raised in boom"):
        echo._wait(refs[1:], "boom", ranks=[1])
    with pytest.raises(ValueError, match="1 refs but 2 ranks"):
        echo._wait(refs[1:], "boom", ranks=[0, 1])


def test_killed_worker_fails_fast_within_timeout(ray_cluster):
    g = make_group(EchoWorker, name="victim", timeout_s=30)
    fut = g.execute_all_async("sleep", 20)
    time.sleep(1.0)
    os.kill(g.pids[1], 9)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"victim: rank 1 died during sleep") as err:
        g._wait(fut, "sleep")
    assert time.monotonic() - t0 < 15
    assert err.value.died == ("victim", 1)  # names the rank's log file (hybridflow/run_logs.py)
    g.shutdown()


def test_worker_killed_for_memory_is_one_line_with_the_numbers(echo, monkeypatch):
    """Ray's memory monitor kills a worker with a report of dozens of lines (object-store stats,
    top processes); the error keeps its first line, with the numbers, and says what happened."""
    import ray

    refs = echo.execute_all_async("who", "t")
    real_get = ray.get
    report = ("1 worker(s) were killed due to the node running low on memory. Memory on the node was "
              "22.63GB used / 23.54GB limit (0.961247)\nObject store memory usage: [- objects spillable: 0")

    def get(ref, *args, **kwargs):
        if ref == refs[1]:
            raise ray.exceptions.OutOfMemoryError(report)
        return real_get(ref, *args, **kwargs)

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(WorkerMemoryError, match=r"echo: rank 1 was killed for lack of host memory during who "
                                                r"\(1 worker\(s\) were killed .* 22\.63GB used / 23\.54GB limit") as err:
        echo._wait(refs, "who")
    assert "Object store" not in str(err.value) and isinstance(err.value, WorkerGroupError)
    monkeypatch.undo()


def test_hung_call_times_out(ray_cluster):
    g = make_group(EchoWorker, name="slowpoke", timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"slowpoke: sleep did not finish within 2s on ranks \[0, 1\]"):
        g.sleep(30)
    assert time.monotonic() - t0 < 5
    g.shutdown()


def test_start_up_has_its_own_bound(ray_cluster):
    """A short trainer.call_timeout_s no longer cuts a slow but healthy init_model: start-up
    calls are bounded by init_timeout_s, through the colocated role views too."""
    pool = ResourcePool([2], cpus_per_slot=0.5, ready_timeout_s=60)
    _POOLS.append(pool)
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(EchoWorker)})
    g = RayWorkerGroup(pool, cls, name_prefix="startup", timeout_s=1, init_timeout_s=30)
    actor = g.spawn(["actor"])["actor"]
    assert actor.init_model(2) == [0, 1]
    with pytest.raises(WorkerGroupError, match=r"startup/actor: sleep did not finish within 1s .*call_timeout_s"):
        actor.sleep(2)
    short = RayWorkerGroup(None, None, name_prefix="short", timeout_s=1, _actors=actor.actors,
                           _method_prefix="actor__", _worker_cls=cls.cls)
    with pytest.raises(WorkerGroupError, match=r"init_model did not finish within 1s .*trainer.init_timeout_s"):
        short.init_model(2)
    g.shutdown()


def test_more_workers_than_resources_is_a_clear_error(ray_cluster):
    with pytest.raises(ResourceError, match="needs 32 CPU"):
        make_group(EchoWorker, 64, name="toobig")
