"""The one place that decides the device and the collective backend.

Every other module asks here instead of calling ``torch.cuda`` (a test enforces it), so the same
code runs on a 2-core laptop (cpu + gloo) and on a GPU node (cuda + nccl).
"""
from __future__ import annotations

import datetime
import os

# On CPUs that advertise AMX, oneDNN picks AMX bf16 kernels that die with SIGILL on this machine
# kind; capping the ISA at AVX512-BF16 keeps bf16 matmuls working (measured: any bf16 nn.Linear
# crashed without it). Why: the VM reports CPUID leaves only up to 0x1C, so oneDNN reads an empty
# tile palette (leaf 0x1D) and never configures the tiles; its first TILEZERO faults. AMX itself
# works here (a hand-configured tile multiply ran). Must be set before oneDNN creates its first
# primitive, hence at import.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


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
