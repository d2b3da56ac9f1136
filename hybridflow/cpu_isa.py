"""A switch that makes this machine's CPU answer as an AVX2-only one: ``HYBRIDFLOW_CPU_ISA=avx2``.

Machines of this project's kind come with different CPUs (docs/environment.md): AVX512-BF16,
AVX512, and AVX2/FMA only. On AVX2 vLLM loads its AVX2 kernel library, which has no shared-memory
collectives (hybridflow/shm_group.py falls back to gloo, vLLM's TP communicator to
torch.distributed), and a bf16 matmul runs about 25x slower than fp32 (param_dtype=auto picks fp32).
A test that depends on those capabilities asks for them; with this switch a newer CPU runs every
such path the way the AVX2 machine does, so one can reproduce its CI before submitting:

    HYBRIDFLOW_CPU_ISA=avx2 CI=true bash .ci/run

What it changes, in every process that imports :mod:`hybridflow.device` (Ray workers and spawned
ranks inherit the variable):
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN runs its AVX2 kernels, so bf16 matmuls really are slow and the
  speed probe (``device.cpu_bf16_speedup``) measures what the AVX2 machine measures;
- ``ATEN_CPU_CAPABILITY=avx2``: ATen's vectorised kernels take their AVX2 code (other float
  summation orders, as there);
- ``torch.cpu``'s AVX512 flags read False, so vLLM loads ``_C_AVX2`` (no shared-memory kernels).

The two environment variables take full effect only where they are set before the process's first
matmul; set ``HYBRIDFLOW_CPU_ISA`` in the shell, not from inside a running program.
"""
from __future__ import annotations

import functools
import os

ENV = "HYBRIDFLOW_CPU_ISA"
_CHOICES = ("avx2", "native")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The first CPU's model name and feature flags from /proc/cpuinfo ("" and an empty set where
    there is none): what the speed figures and the calibration cache depend on."""
    model, flags, _ = _first_cpu()
    return model, set(flags)


def cpuid_level() -> int:
    """The highest basic CPUID leaf the CPU reports, from /proc/cpuinfo (0 where it says none)."""
    return _first_cpu()[2]


@functools.cache
def _first_cpu() -> tuple[str, frozenset[str], int]:
    """Model name, flags and ``cpuid level`` of the first CPU in /proc/cpuinfo, read once a process
    (every process that imports hybridflow.device asks at import)."""
    model, flags, level = "", frozenset(), 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                elif key == "cpuid level" and not level:
                    level = int(value) if value.strip().isdigit() else 0
                if model and flags and level:
                    break
    except OSError:
        pass
    return model, flags, level


# CPUID leaf 0x1D describes AMX's tile palettes; a CPU that lists AMX but reports fewer leaves
# (an Intel VM of this project's kind reported up to 0x1C) leaves oneDNN with an empty palette.
AMX_TILE_LEAF = 0x1D


def amx_tiles_described() -> bool:
    """Whether the CPU lists AMX tiles and reports the leaf that describes them."""
    return "amx_tile" in cpu_model_and_flags()[1] and cpuid_level() >= AMX_TILE_LEAF


def onednn_isa_cap() -> str | None:
    """The cap oneDNN needs on this CPU (``ONEDNN_MAX_CPU_ISA``), or None for its own choice.

    oneDNN's AMX kernels die with SIGILL on a CPU that lists AMX without the tile leaf: oneDNN
    reads an empty palette, never configures the tiles, and its first TILEZERO faults (measured on
    an Intel VM; a hand-configured tile multiply ran there). Capped at AVX512-BF16, a bf16 matmul
    ran at 0.6-0.7x fp32 there; where the leaf is reported, AMX ran one 6x faster than fp32
    (Xeon, model 207, 2026-12-01), so the cap is only for the first kind."""
    if forced_avx2():
        return "AVX2"
    if "amx_tile" in cpu_model_and_flags()[1] and cpuid_level() < AMX_TILE_LEAF:
        return "AVX512_CORE_BF16"
    return None


def enable_amx() -> bool:
    """Ask Linux for this process's permission to use AMX tile data (``arch_prctl``), after torch
    is imported; returns whether vLLM may use AMX.

    Linux gives a process AMX's large register state only on request. oneDNN asks before its own
    AMX kernels run, but vLLM's CPU attention picks its AMX kernel for bf16 from
    ``torch.cpu._is_amx_tile_supported()`` and never asks: without this, a bf16 rollout died with
    SIGILL in ``cpu_attention_with_kv_cache`` (Xeon, model 207). Where permission is refused or
    the tile leaf is missing, torch.cpu reports no AMX and vLLM takes its AVX512 attention."""
    import torch.cpu

    if not hasattr(torch.cpu, "_is_amx_tile_supported") or not torch.cpu._is_amx_tile_supported():
        return False
    if amx_tiles_described() and torch.cpu._init_amx():
        return True
    _report_absent("_is_amx_tile_supported", "_is_amx_fp16_supported")
    return False


def forced_avx2() -> bool:
    """Whether this process should behave as on an AVX2-only CPU."""
    value = os.environ.get(ENV, "native").strip().lower() or "native"
    if value not in _CHOICES:
        raise ValueError(f"{ENV}={value!r}: use avx2 (act as an AVX2-only CPU) or native (or unset it)")
    return value == "avx2"


def apply_env() -> None:
    """Before torch's first matmul: cap oneDNN where this CPU needs it (:func:`onednn_isa_cap`), and
    point oneDNN and ATen at their AVX2 code when forced. A cap the user set is kept."""
    cap = onednn_isa_cap()
    if forced_avx2():
        os.environ["ONEDNN_MAX_CPU_ISA"] = cap
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    elif cap:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", cap)


def hide_avx512_from_torch() -> None:
    """When forced, torch.cpu reports no AVX512: vLLM picks its kernel library from these flags
    when it first loads its ops, so this must run before ``import vllm._custom_ops``."""
    if not forced_avx2():
        return
    _report_absent("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _report_absent(*flags: str) -> None:
    """Make these ``torch.cpu`` capability checks answer False (those this torch has)."""
    import torch.cpu

    for flag in flags:
        if hasattr(torch.cpu, flag):
            setattr(torch.cpu, flag, _false)


def _false() -> bool:
    return False
