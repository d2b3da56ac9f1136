"""The environment a worker process starts with: a large model's CPU tensors on huge pages, a
small one's left to glibc, the user's choice kept."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from recipes.worker_env import has_tensors_beyond_malloc_reuse, worker_env

CFG = SimpleNamespace(trainer=SimpleNamespace(call_timeout_s=600.0, device="cpu"))
QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936}
CHAR_MEDIUM = {"model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1536, "vocab_size": 64}


def _model_dir(tmp_path, config: dict, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_huge_pages_only_for_models_whose_tensors_glibc_would_not_reuse(tmp_path, monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    big, small = _model_dir(tmp_path, QWEN25_05B, "big"), _model_dir(tmp_path, CHAR_MEDIUM, "small")
    # 151936 x 896 fp32 = 544 MB per embedding-sized tensor, far past glibc's 32 MB mmap limit
    assert has_tensors_beyond_malloc_reuse(big) and worker_env(CFG, big)["THP_MEM_ALLOC_ENABLE"] == "1"
    # 1536 x 512 fp32 = 3 MB: glibc reuses such blocks by itself
    assert not has_tensors_beyond_malloc_reuse(small) and "THP_MEM_ALLOC_ENABLE" not in worker_env(CFG, small)
    # a multimodal config keeps its language model's sizes under text_config
    nested = _model_dir(tmp_path, {"model_type": "x", "text_config": QWEN25_05B}, "nested")
    assert has_tensors_beyond_malloc_reuse(nested)
    assert not has_tensors_beyond_malloc_reuse(str(tmp_path / "missing"))
    assert not has_tensors_beyond_malloc_reuse(None)
    # the user's setting wins either way
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert worker_env(CFG, big)["THP_MEM_ALLOC_ENABLE"] == "0"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert worker_env(CFG, small)["THP_MEM_ALLOC_ENABLE"] == "1"


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _probe():
    """In the worker: the variable it started with, and how much of a freshly written 64 MB
    tensor the kernel backs with huge pages (AnonHugePages of the mapping that holds it)."""
    import os

    import torch

    x = torch.ones(16 << 20)
    addr = x.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return os.environ.get("THP_MEM_ALLOC_ENABLE"), int(line.split()[1])
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), 0


@pytest.mark.slow
@pytest.mark.skipif(not _thp_available(), reason="the kernel has transparent huge pages off")
def test_ray_worker_of_a_large_model_puts_big_cpu_tensors_on_huge_pages(ray_cluster, tmp_path, monkeypatch):
    # PyTorch reads THP_MEM_ALLOC_ENABLE once per process: the test is that Ray's runtime_env
    # puts it there before the worker imports torch, and that torch (as pinned) still honours it
    # by advising the kernel to back >= 2 MB CPU tensors with huge pages.
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    big = _model_dir(tmp_path, QWEN25_05B, "big")
    probe = ray_cluster.remote(num_cpus=0)(_probe)
    value, huge_kb = ray_cluster.get(probe.options(runtime_env={"env_vars": worker_env(CFG, big)}).remote())
    assert value == "1" and huge_kb >= 2048

    # a user who turns it off keeps it off in the workers
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    env = worker_env(CFG, big)
    value, _ = ray_cluster.get(probe.options(runtime_env={"env_vars": {**env, "PROBE": "off"}}).remote())
    assert env["THP_MEM_ALLOC_ENABLE"] == value == "0"


def test_start_up_collectives_get_the_start_up_bound(monkeypatch):
    """init_model's collectives wait on the slowest rank's loading: the workers' torch.distributed
    timeout is the larger of trainer.call_timeout_s and trainer.init_timeout_s."""
    monkeypatch.setenv("HYBRIDFLOW_CPU_ISA", "avx2")
    cfg = SimpleNamespace(trainer=SimpleNamespace(call_timeout_s=60.0, init_timeout_s=1800.0, device="cpu"))
    env = worker_env(cfg)
    assert env["HYBRIDFLOW_CALL_TIMEOUT_S"] == "60.0" and env["HYBRIDFLOW_DIST_TIMEOUT_S"] == "1800.0"
    assert env["HYBRIDFLOW_CPU_ISA"] == "avx2"  # workers on other nodes act as AVX2-only too


def test_a_recipes_ray_runtime_env_adds_the_quiet_console_to_the_worker_env(tmp_path, monkeypatch):
    """Workers of a quiet run write to <run>/logs (hybridflow/run_logs.py); verbose, they get the
    worker environment alone, as before."""
    from recipes.worker_env import ray_runtime_env

    monkeypatch.delenv("HYBRIDFLOW_VERBOSE", raising=False)
    monkeypatch.delenv("VERL_LOGGING_LEVEL", raising=False)
    cfg = SimpleNamespace(trainer=SimpleNamespace(call_timeout_s=60.0, device="cpu", default_local_dir=str(tmp_path)))
    runtime = ray_runtime_env(cfg)
    assert runtime["env_vars"] == {**worker_env(cfg), "HYBRIDFLOW_LOG_DIR": str(tmp_path / "logs"),
                                   "VLLM_CONFIGURE_LOGGING": "0"}
    assert runtime["worker_process_setup_hook"] == "hybridflow.run_logs.redirect_worker_output"
    monkeypatch.setenv("HYBRIDFLOW_VERBOSE", "1")
    assert ray_runtime_env(cfg) == {"env_vars": worker_env(cfg)}
