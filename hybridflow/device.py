"""The one place that decides the device and the collective backend.

Every other module asks here instead of calling ``torch.cuda`` (a test enforces it), so the same
code runs on a 2-core laptop (cpu + gloo) and on a GPU node (cuda + nccl).
"""
from __future__ import annotations

import datetime
import functools
import os
import time

# oneDNN's ISA cap (where AMX is listed but unusable) and HYBRIDFLOW_CPU_ISA=avx2 (run as an
# AVX2-only CPU would) must be in the environment before oneDNN creates its first primitive, hence
# at import (cpu_isa.py).
from hybridflow import cpu_isa  # noqa: E402

cpu_isa.apply_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# both before anything loads vLLM's kernels, which pick their ISA from torch.cpu's flags
cpu_isa.hide_avx512_from_torch()
cpu_isa.enable_amx()


def device_type() -> str:
    """"cuda" when a GPU is visible and not disabled with HYBRIDFLOW_DEVICE=cpu, else "cpu"."""
    forced = os.environ.get("HYBRIDFLOW_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def uses_gpu(requested: str) -> bool:
    """Whether a run with ``trainer.device=requested`` (auto | cpu | cuda) runs on GPUs."""
    return requested == "cuda" or (requested == "auto" and device_type() == "cuda")


def dist_backend() -> str:
    return "nccl" if device_type() == "cuda" else "gloo"


def device_count() -> int:
    return torch.cuda.device_count() if device_type() == "cuda" else 0


def torch_device(local_rank: int | None = None) -> torch.device:
    if device_type() == "cuda":
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_local_device(local_rank: int) -> None:
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank)


def empty_cache() -> None:
    if device_type() == "cuda":
        torch.cuda.empty_cache()


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def peak_memory_bytes() -> int:
    """Peak accelerator memory on GPU; peak resident set size of this process on CPU.

    On Linux the CPU figure is VmHWM from /proc: getrusage's ru_maxrss is inherited across
    fork+exec, so a spawned worker would report its parent's peak."""
    if device_type() == "cuda":
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def allocated_memory_bytes() -> int:
    """Accelerator memory held by tensors now (GPU); 0 on CPU."""
    return int(torch.cuda.memory_allocated()) if device_type() == "cuda" else 0


def device_name() -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(torch.cuda.current_device()) if device_type() == "cuda" else "cpu"


def reset_peak_memory() -> None:
    if device_type() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device_type() == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if device_type() == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# param_dtype=auto (the recipes' default): bf16 compute wherever bf16 matmuls are native. On a
# GPU that is every card since Ampere. On a CPU the flags do not tell: this project's machines
# measured bf16 at 0.7x fp32 on one (AMX hidden by the VM, see above; oneDNN falls back to
# AVX512-BF16) and at 4.6x on another (AVX512-BF16 on 512-bit units, while MKL's fp32 GEMM runs
# its AVX2 path on that vendor). So the CPU is asked by timing one matmul in both dtypes.
AUTO_DTYPE_ENV = "HYBRIDFLOW_AUTO_DTYPE"
BF16_MIN_SPEEDUP = 1.5  # outcomes seen: 0.7x on one kind, 4.2-5.1x on the other (under load too)


@functools.cache
def cpu_bf16_speedup(rows: int = 256, dim: int = 512, repeats: int = 7) -> float:
    """fp32 time / bf16 time of one ``[rows, dim] @ [dim, dim]`` matmul on one thread (a worker's
    share; best of ``repeats`` after a warm-up; about 20 ms in all). Cached: it asks the CPU, not
    the load of the moment."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return (_best_matmul_s(torch.float32, rows, dim, repeats)
                    / _best_matmul_s(torch.bfloat16, rows, dim, repeats))
    finally:
        torch.set_num_threads(threads)


def _best_matmul_s(dtype: torch.dtype, rows: int, dim: int, repeats: int) -> float:
    a, b = torch.randn(rows, dim, dtype=dtype), torch.randn(dim, dim, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 2):  # the first calls create oneDNN's kernels
        start = time.perf_counter()
        torch.mm(a, b)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return best


def auto_param_dtype(on_gpu: bool) -> tuple[str, str]:
    """What ``param_dtype=auto`` means here: ("bf16" | "fp32", why).

    ``HYBRIDFLOW_AUTO_DTYPE=fp32|bf16`` decides without asking (the test suite pins fp32 so that
    its tolerances hold on every machine kind)."""
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in ("fp32", "bf16"):
            raise ValueError(f"{AUTO_DTYPE_ENV}={forced!r}: use fp32 or bf16 (or unset it to measure)")
        return forced, f"{AUTO_DTYPE_ENV}={forced}"
    if on_gpu:
        # the driver may see no GPU (workers on other nodes): assume a card from Ampere on, as verl does
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
            return "fp32", f"{torch.cuda.get_device_name()} has no native bf16"
        return "bf16", "GPU"
    speedup = cpu_bf16_speedup()
    verdict = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    return verdict, f"{bf16_speed_words(speedup)} on this CPU (bf16 where it is {BF16_MIN_SPEEDUP}x faster)"


def bf16_speed_words(speedup: float) -> str:
    """The probe's ratio as a user reads it: "4.6x faster", "25x slower" (a ratio of 0.04 printed
    as "0.0x as fast" read as "does not run at all")."""
    if speedup >= 1.05:
        return f"bf16 matmuls run {_ratio(speedup)}x faster than fp32"
    if speedup <= 1 / 1.05:
        return f"bf16 matmuls run {_ratio(1 / speedup)}x slower than fp32"
    return "bf16 and fp32 matmuls run at the same speed"


def _ratio(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"  # two significant figures, never 1e+02


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the torch.distributed world described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

    Idempotent. The timeout bounds every collective, so a dead peer fails the call instead of
    hanging it (DESIGN.md: every collective has a timeout).
    """
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    set_local_device(local_rank)
    # NCCL: bind the world to this rank's GPU up front (barriers and the first collective then
    # know their device instead of guessing it from the current context)
    bound = {"device_id": torch_device(local_rank)} if device_type() == "cuda" else {}
    dist.init_process_group(
        backend=dist_backend(),
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
        **bound,
    )
