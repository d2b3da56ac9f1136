"""The environment every Ray worker process starts with (Ray's runtime_env), for every recipe."""
from __future__ import annotations

import os

from hybridflow import run_logs
from hybridflow.model_checks import read_model_config

# glibc serves a block above its mmap threshold from fresh pages and returns them to the kernel on
# free; the threshold adapts to what a process frees but never beyond 32 MiB on 64-bit Linux
# (DEFAULT_MMAP_THRESHOLD_MAX). Tensors larger than that are faulted in again, 4 KB at a time,
# every time they are allocated.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20


def worker_env(cfg, model_path: str | None = None) -> dict[str, str]:
    """Environment every Ray worker starts with. (Not VLLM_CPU_KVCACHE_SPACE: the rollout sizes
    vLLM's KV cache to the byte from rollout.kv_cache_gib; that variable only takes whole GiB.)"""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "HYBRIDFLOW_CALL_TIMEOUT_S": str(cfg.trainer.call_timeout_s),
           # the collectives of a start-up call (init_model) need the start-up bound
           "HYBRIDFLOW_DIST_TIMEOUT_S": str(max(cfg.trainer.call_timeout_s,
                                                getattr(cfg.trainer, "init_timeout_s", 0.0))),
           "HYBRIDFLOW_DEVICE": os.environ.get("HYBRIDFLOW_DEVICE", ""),
           "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE",
                                                  "1" if has_tensors_beyond_malloc_reuse(model_path) else ""),
           # opt-in shared-memory TP all-reduces (hybridflow/shm_group.py); forwarded because
           # workers on a cluster do not inherit the driver's environment
           "HYBRIDFLOW_SHM_COLLECTIVES": os.environ.get("HYBRIDFLOW_SHM_COLLECTIVES", ""),
           # run the workers as on an AVX2-only CPU too (hybridflow/cpu_isa.py)
           "HYBRIDFLOW_CPU_ISA": os.environ.get("HYBRIDFLOW_CPU_ISA", "")}
    if cfg.trainer.device in ("cpu", "cuda"):
        env["HYBRIDFLOW_DEVICE"] = cfg.trainer.device
    return {k: v for k, v in env.items() if v}


def ray_runtime_env(cfg, model_path: str | None = None) -> dict:
    """``ray.init``'s runtime_env for a recipe's own Ray instance: :func:`worker_env`, and unless the
    user asked for every line on the console, each worker's output into the run's log folder."""
    quiet = run_logs.ray_runtime_env(cfg.trainer.default_local_dir)
    return {**quiet, "env_vars": {**worker_env(cfg, model_path), **quiet.get("env_vars", {})}}


def has_tensors_beyond_malloc_reuse(model_path: str | None) -> bool:
    """Whether the model's largest weight matrix (and so its gradient, its optimizer moments and
    its logits) in fp32 exceeds what glibc ever reuses: then workers get THP_MEM_ALLOC_ENABLE=1.

    With it PyTorch asks for transparent huge pages for every CPU tensor of 2 MB or more: a fault
    maps 2 MB instead of 4 KB, and freed tensors still go back to the OS. At a Qwen2.5-0.5B shape
    on CPU the faults were a quarter to a third of a GRPO step (scripts/bench/memory.py, Megatron
    TP=2: 15.7 -> 10.8 and 16.7 -> 12.9 s per step, peak host memory 1.4-1.6 GB lower). Below
    the threshold glibc already reuses freed memory and the advice only costs (a 25M-parameter
    model with a 100-token vocabulary stepped 2-14% slower end to end with it, in four runs).
    Keeping freed memory in glibc (MALLOC_MMAP_THRESHOLD_) was faster still in one process but
    ran the same run out of memory.
    PyTorch reads the variable once per process, so it must be set where the worker starts; a
    value in the driver's environment (0 or 1) wins over this choice."""
    config = read_model_config(model_path) if model_path else None
    if not config:
        return False
    config = config.get("text_config", config)
    hidden = config.get("hidden_size") or 0
    largest = hidden * max(config.get("vocab_size") or 0, config.get("intermediate_size") or 0)
    return 4 * largest > GLIBC_MMAP_THRESHOLD_MAX
