"""The machine's calibration (hybridflow/placement/calibrate.py) is measured once per CPU, torch,
thread count and model size, and read back from its JSON cache as the same profile; the slow
measuring is a stand-in here (its real run is scripts/bench/planner.py's first step)."""
import json
import os

import pytest

from hybridflow.placement import calibrate as cal
from hybridflow.placement.workload import ModelShape, Workload

SHAPE = ModelShape("m", 64, 2, 4, 2, 128, 128, tied=True)
WORKLOAD = Workload(actor=SHAPE, critic=SHAPE, prompts=8, samples_per_prompt=2, prompt_len=16, response_len=8,
                    micro_batch=4, recompute=False)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """calibrate.measure replaced by a counter returning fixed rates; the cache in tmp_path."""
    monkeypatch.setenv(cal.CACHE_DIR_ENV, str(tmp_path))
    calls = []

    def measure(actor, batch, threads, log=None):
        calls.append((actor, batch, threads))
        rates = {"fwd_flops": {"fp32": 1e11, "bf16": 4e11}, "train_flops": {"fp32": 8e10, "bf16": 3e11},
                 "decode_flops": {"fp32": 1e11, "bf16": 2e11}, "decode_step_s": 8e-3,
                 "decode_step_s_by_dtype": {"fp32": 8e-3, "bf16": 5e-3}, "collective_latency_s": 2e-4,
                 "threads": threads}
        return {"profile": {"name": f"cpu-{threads}t", "flops": {"fp32": 1.1e11, "bf16": 5e11}, "mem_bytes": 8e9,
                            "mem_bw": 4e10, "intra_node_bw": 1.5e9, "inter_node_bw": 1.5e9, "measured": rates,
                            "source": "stand-in"}}

    monkeypatch.setattr(cal, "measure", measure)
    return calls


def test_cache_round_trip(measured, tmp_path):
    first = cal.calibrate(WORKLOAD, threads=1, slots=2)
    assert len(measured) == 1 and not first.cached
    assert os.path.dirname(first.path) == str(tmp_path) and os.path.exists(first.path)
    again = cal.calibrate(WORKLOAD, threads=1, slots=2)
    assert len(measured) == 1 and again.cached  # read back, not measured
    assert again.device == first.device and again.measured == first.measured
    assert again.measured["collective_latency_s"] == 2e-4
    # the host's memory is shared by the slots
    assert again.device.mem_bytes == pytest.approx(cal.host_memory_bytes() / 2)
    assert cal.calibrate(WORKLOAD, threads=1, refresh=True).cached is False and len(measured) == 2
    # the planner's argument: measured rates on the device, CPU constants beside
    arg = first.planner_arg()
    assert arg["device"].measured["fwd_flops"]["bf16"] == 4e11 and arg["constants"]["dp_overlap"] == 0.0


def test_a_damaged_cache_file_is_measured_again(measured):
    path = cal.calibrate(WORKLOAD).path
    with open(path, "w") as f:
        f.write("{not json")
    assert cal.calibrate(WORKLOAD).cached is False and len(measured) == 2
    with open(path) as f:
        assert json.load(f)["profile"]["source"] == "stand-in"


def test_key_changes_with_what_the_rates_depend_on(measured, monkeypatch):
    batch = {"micro": 4, "seq": 24, "decode_batch": 16, "prompt": 16}
    key = cal.cache_key(1, SHAPE, batch)
    assert cal.cache_key(1, SHAPE, batch) == key
    assert cal.cache_key(2, SHAPE, batch) != key  # threads per slot
    assert cal.cache_key(1, ModelShape("m", 128, 2, 4, 2, 256, 128), batch) != key  # model size
    assert cal.cache_key(1, SHAPE, {**batch, "seq": 48}) != key  # the sizes measured at
    monkeypatch.setattr(cal, "cpu_identity", lambda: "Another CPU|avx2 fma")
    assert cal.cache_key(1, SHAPE, batch) != key  # CPU model and flags
    import torch

    monkeypatch.setattr(cal, "cpu_identity", lambda: "x|y")
    other = cal.cache_key(1, SHAPE, batch)
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert cal.cache_key(1, SHAPE, batch) != other  # torch version
    # a different thread count is a different file: calibrating 2 threads measures again
    cal.calibrate(WORKLOAD, threads=1)
    cal.calibrate(WORKLOAD, threads=2)
    assert [c[2] for c in measured] == [1, 2]


def test_cpu_identity_names_model_and_flags():
    ident = cal.cpu_identity()
    model, flags = ident.split("|", 1)
    assert model
    if os.path.exists("/proc/cpuinfo"):
        assert flags and flags == " ".join(sorted(flags.split()))


def test_the_gloo_probe_runs_after_this_process_started_openmp_threads(monkeypatch):
    """calibrate() at 2 threads (n_gpus_per_node=auto's one-worker candidate) probes gloo after the
    parent ran multi-threaded matmuls: forked ranks hung there, spawned ones do not."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(256, 256) @ torch.randn(256, 256)  # starts OpenMP's pool in this process
        out = cal.gloo_collectives(2)
    finally:
        torch.set_num_threads(threads)
    assert out["collective_latency_s"] > 0 and out["all_reduce_bw"] > 0 and out["all_gather_bw"] > 0


def test_the_cache_key_tells_the_avx2_switch_apart(monkeypatch):
    shape = ModelShape("m", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=128)
    monkeypatch.delenv("HYBRIDFLOW_CPU_ISA", raising=False)
    native = cal.cache_key(1, shape, {"micro": 4})
    monkeypatch.setenv("HYBRIDFLOW_CPU_ISA", "avx2")
    assert cal.cache_key(1, shape, {"micro": 4}) != native
