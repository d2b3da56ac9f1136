"""Stage spans: the recorder (disjoint pieces, bounded, off by default), the @register wrapper that
records every group method, and the trainer's StageTimeline over real Ray workers."""
import json
import time

import pytest
import torch

from hybridflow.controller import (Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker,
                                   create_colocated_worker_cls, register, spans)
from hybridflow.protocol import DataProto
from hybridflow.trainer.timeline import StageTimeline, timer


@pytest.fixture
def recording():
    spans.enable()
    yield
    spans.enable(False)


class Stages(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def work(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, data: DataProto):
        with spans.span("weight_sync"):
            time.sleep(0.02)
        time.sleep(0.03)
        return data


def _disjoint(got):
    return all(a[2] <= b[1] for a, b in zip(got, got[1:])) and all(s < e for _, s, e in got)


def test_off_by_default_records_nothing():
    assert not spans.recording()
    Stages().work(0)
    with spans.span("x"):
        pass
    assert spans.take() == []


def test_nested_span_splits_its_parent_into_disjoint_pieces(recording):
    rows = DataProto.from_dict({"x": torch.zeros(2, 1)})
    Stages().generate_sequences(rows)
    got = spans.take()
    assert [name for name, _, _ in got] == ["generate_sequences", "weight_sync", "generate_sequences"]
    assert _disjoint(got)
    assert got[1][2] - got[1][1] == pytest.approx(0.02, abs=0.015)
    rows.meta_info["stage"] = "validation"  # a caller names the stage of a shared method
    Stages().generate_sequences(rows)
    assert {name for name, _, _ in spans.take()} == {"validation", "weight_sync"}
    assert spans.take() == []  # taken once


def test_recording_is_bounded(recording, monkeypatch):
    spans.enable(False)
    monkeypatch.setattr(spans, "MAX_SPANS", 5)
    spans.enable()
    for _ in range(20):
        Stages().work(0.0001)
    assert len(spans.take()) == 5


def test_driver_timers_record_their_own_stages_not_their_waits(recording):
    metrics = {}
    with timer("step", metrics):
        with timer("gen", metrics):
            time.sleep(0.01)
        with timer("adv", metrics):
            time.sleep(0.01)
    assert [name for name, _, _ in spans.take()] == ["adv"]
    assert {"timing_s/step", "timing_s/gen", "timing_s/adv"} <= set(metrics)


@pytest.mark.slow
def test_stage_timeline_over_ray_workers_one_track_per_process(ray_cluster, tmp_path):
    """Colocated roles share their slot's process and so its track; a second pool has its own."""
    pools = [ResourcePool([2], cpus_per_slot=0.5, ready_timeout_s=60), ResourcePool([1], cpus_per_slot=0.5,
                                                                                    ready_timeout_s=60)]
    try:
        cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Stages), "ref": RayClassWithInitArgs(Stages)})
        groups = RayWorkerGroup(pools[0], cls, name_prefix="main").spawn(["actor", "ref"])
        groups["critic"] = RayWorkerGroup(pools[1], RayClassWithInitArgs(Stages), name_prefix="side")
        timeline = StageTimeline(groups, on=True)
        assert timeline.tracks == ["main rank 0", "main rank 1", "side rank 0", "driver"]
        metrics = {}
        with timeline.step(1, metrics):
            groups["actor"].generate_sequences(DataProto.from_dict({"x": torch.zeros(4, 1)}))
            groups["ref"].work(0.05)
            with timer("adv", metrics):
                time.sleep(0.02)
            time.sleep(0.2)  # everyone idle
        for track in ("main rank 0", "main rank 1"):
            assert [n for n, _, _ in timeline.spans[track]] == ["generate_sequences", "weight_sync",
                                                                "generate_sequences", "work"]
            assert _disjoint(timeline.spans[track])
        assert timeline.spans["side rank 0"] == [] and [n for n, _, _ in timeline.spans["driver"]] == ["adv"]
        assert metrics["perf/idle_frac/side"] == 1.0
        assert 0.3 < metrics["perf/idle_frac/main"] < 0.95
        json_path, png_path = timeline.write(str(tmp_path))
        with open(json_path) as f:
            names = {e["args"]["name"] for e in json.load(f)["traceEvents"] if e["name"] == "thread_name"}
        assert names == {"main rank 0", "main rank 1", "side rank 0", "driver", "steps"}
        assert (tmp_path / "timeline.png").stat().st_size > 0 and png_path.endswith("timeline.png")
        assert not spans.recording()  # the driver stops recording with the run
        groups["actor"].shutdown()
        groups["critic"].shutdown()
    finally:
        spans.enable(False)
        for pool in pools:
            pool.release()
