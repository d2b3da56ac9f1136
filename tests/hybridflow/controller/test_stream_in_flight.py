"""``GenerationStream.in_flight`` lists only refs that have not answered (hybridflow/controller/stream.py).

A TP group's call is handled once every rank answered; until then the ranks that did answer must
leave ``in_flight``: ``ray.wait`` returns an answered ref at once, so the controller's loop (the
fused rollout waits on ``in_flight`` with its own refs) would spin on a core the workers need. A
fake group of one replica of two TP ranks, whose calls answer when the test says (``ray.wait``
replaced)."""
from types import SimpleNamespace

import torch

from hybridflow.controller import stream as stream_module
from hybridflow.controller.stream import DEPTH, GenerationStream
from hybridflow.protocol import DataProto


class _Ref:
    def __init__(self, value, rank):
        self.value, self.rank, self.done = value, rank, False


class _Actor:
    def __init__(self, calls, rank):
        self.calls, self.rank = calls, rank
        self.stream_start = SimpleNamespace(remote=lambda prompts: self._call(len(prompts)))
        self.stream_step = SimpleNamespace(remote=lambda steps: self._call(
            {"rows": None, "unfinished": 1, "steps": steps, "seconds": 0.01 * steps, "done": False}))

    def _call(self, value):
        ref = _Ref(value, self.rank)
        self.calls.append(ref)
        return ref


class _TPGroup:
    """Two ranks, one generation replica (TP = 2), rank 0 collects."""
    name, timeout_s, _prefix = "rollout", 60.0, ""

    def __init__(self):
        self.calls: list[_Ref] = []
        self.actors = [_Actor(self.calls, 0), _Actor(self.calls, 1)]

    def mesh_info(self, name):
        return SimpleNamespace(dp_ranks=[0, 0], collect=[True, False], dp_size=1)

    @staticmethod
    def _wait(refs, method, ranks):
        assert ranks == [r.rank for r in refs]  # an error would name the rank that made the call
        return [r.value for r in refs]


def test_an_answered_rank_leaves_in_flight_until_its_tp_partner_answers(monkeypatch):
    monkeypatch.setattr(stream_module.ray, "wait", lambda refs, num_returns=1, timeout=None:
                        ([r for r in refs if r.done][:num_returns], [r for r in refs if not r.done]))
    group = _TPGroup()
    prompts = DataProto.from_dict({"input_ids": torch.zeros(3, 4, dtype=torch.long)}, meta_info={"n": 1})
    stream = GenerationStream(group, prompts)
    assert len(stream.in_flight) == 2 * DEPTH  # slices queued on both ranks
    first = stream.replicas[0].calls[0][1]
    first[0].done = True  # rank 0 answered its first slice, rank 1 not yet
    assert stream.take([first[0]]) == []
    assert first[0] not in stream.in_flight and first[1] in stream.in_flight
    first[1].done = True
    stream.take([first[1]])  # the slice is handled; the next one is queued
    assert not any(ref.done for ref in stream.in_flight)
    assert len(stream.in_flight) == 2 * DEPTH and stream.unfinished == 1
