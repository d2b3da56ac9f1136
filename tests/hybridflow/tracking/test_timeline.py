"""The stage timeline's writer (Chrome trace, Gantt PNG) and perf/idle_frac/<pool>."""
import json

import matplotlib.image
import pytest

from hybridflow.tracking.timeline import DRIVER, chrome_trace, idle_fractions, plot_gantt, write_chrome_trace

T0 = 1_700_000_000.0  # time.time()-like seconds
TRACKS = ["main rank 0", "main rank 1", "side rank 0", DRIVER]
SPANS = {
    "main rank 0": [("weight_sync", T0 + 0.0, T0 + 1.0), ("generate_sequences", T0 + 1.0, T0 + 4.0),
                    ("compute_log_prob", T0 + 5.0, T0 + 6.0), ("update_actor", T0 + 7.0, T0 + 9.0)],
    "main rank 1": [("generate_sequences", T0 + 0.0, T0 + 2.0), ("update_actor", T0 + 7.0, T0 + 9.0)],
    "side rank 0": [("compute_values", T0 + 5.0, T0 + 6.0)],
    DRIVER: [("reward", T0 + 4.0, T0 + 5.0), ("adv", T0 + 6.0, T0 + 7.0)],
}
STEPS = [(1, T0, T0 + 10.0)]


def _tracks_of(trace):
    """pid -> pool name, (pid, tid) -> track name, (pid, tid) -> [X events]."""
    events = trace["traceEvents"]
    pools = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault((e["pid"], e["tid"]), []).append(e)
    return pools, names, spans


def test_chrome_trace_is_valid_json_with_one_track_per_worker_grouped_by_pool(tmp_path):
    path = write_chrome_trace(str(tmp_path / "run" / "timeline.json"), TRACKS, SPANS, STEPS)
    with open(path) as f:
        trace = json.load(f)
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["origin_unix_s"] == T0
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X") and {"name", "pid", "tid"} <= set(e)
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] > 0
    pools, names, spans = _tracks_of(trace)
    assert sorted(pools.values()) == ["driver", "main", "side"]
    by_name = {name: key for key, name in names.items()}
    assert set(by_name) == set(TRACKS) | {"steps"}  # one track per worker, the driver's and the steps'
    for track in TRACKS:
        assert pools[by_name[track][0]] == track.split(" rank ")[0]
        got = [(e["name"], e["ts"], e["dur"]) for e in spans[by_name[track]]]
        assert got == [(n, pytest.approx((s - T0) * 1e6), pytest.approx((e - s) * 1e6)) for n, s, e in SPANS[track]]
        ordered = sorted(spans[by_name[track]], key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(ordered, ordered[1:]))  # no overlap
    assert [e["name"] for e in spans[by_name["steps"]]] == ["step 1"]


def test_idle_fraction_is_the_mean_share_of_the_step_outside_any_stage():
    idle = idle_fractions(TRACKS, SPANS, T0, T0 + 10.0)
    # main rank 0 busy 1+3+1+2 = 7 of 10 s, rank 1 busy 4; side rank 0 busy 1; the driver is no pool
    assert idle == {"perf/idle_frac/main": pytest.approx((0.3 + 0.6) / 2), "perf/idle_frac/side": pytest.approx(0.9)}
    # spans are clipped to the step; a worker with no span in it is wholly idle
    assert idle_fractions(TRACKS, SPANS, T0 + 8.0, T0 + 10.0)["perf/idle_frac/main"] == pytest.approx(0.5)
    assert idle_fractions(["x rank 0"], {}, T0, T0 + 1.0) == {"perf/idle_frac/x": 1.0}
    # overlapping spans (never recorded, but the union is what counts) are not counted twice
    assert idle_fractions(["x rank 0"], {"x rank 0": [("a", T0, T0 + 0.6), ("b", T0 + 0.4, T0 + 0.8)]},
                          T0, T0 + 1.0) == {"perf/idle_frac/x": pytest.approx(0.2)}


def test_gantt_png_is_written_one_row_per_track(tmp_path):
    path = plot_gantt(str(tmp_path / "timeline.png"), TRACKS, SPANS, STEPS * 1 + [(2, T0 + 10.0, T0 + 12.0)])
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (int(100 * (1.2 + 0.45 * len(TRACKS))), 1200)
    assert image.std() > 0.05  # bars, labels and legend drawn
    # nothing recorded (a run that failed at once) still draws an empty chart rather than raising
    plot_gantt(str(tmp_path / "empty.png"), [DRIVER], {DRIVER: []}, [])
    assert chrome_trace([DRIVER], {DRIVER: []}, [])["traceEvents"][0]["args"] == {"name": "driver"}
