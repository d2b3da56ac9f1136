"""What each CPU kind gets from hybridflow/cpu_isa.py: oneDNN's cap only where AMX is listed but its
tile leaf is missing, and vLLM told of AMX only where this process may use it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridflow import cpu_isa

AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, level, forced, cap", [
    (AMX, 0x1C, "", "AVX512_CORE_BF16"),  # the Intel VM: oneDNN's AMX kernels die with SIGILL
    (AMX, 0x20, "", None),  # tiles described: oneDNN's own choice (AMX, 6x fp32 in bf16)
    ({"avx512f", "avx512_bf16"}, 0x10, "", None),  # no AMX listed: nothing to cap
    ({"avx2", "fma"}, 0x10, "", None),
    (AMX, 0x20, "avx2", "AVX2"),  # run as an AVX2-only CPU would
])
def test_onednn_is_capped_only_where_it_must_be(monkeypatch, flags, level, forced, cap):
    monkeypatch.setattr(cpu_isa, "cpu_model_and_flags", lambda: ("cpu", set(flags)))
    monkeypatch.setattr(cpu_isa, "cpuid_level", lambda: level)
    monkeypatch.setenv(cpu_isa.ENV, forced or "native")
    assert cpu_isa.onednn_isa_cap() == cap


def test_a_user_cap_is_kept_and_the_avx2_switch_overrides_it(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_model_and_flags", lambda: ("cpu", set(AMX)))
    monkeypatch.setattr(cpu_isa, "cpuid_level", lambda: 0x1C)
    # a copy: apply_env writes the variables later subprocesses of this test process would inherit
    environ = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", cpu_isa.ENV: "native"}
    monkeypatch.setattr(cpu_isa.os, "environ", environ)
    cpu_isa.apply_env()
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE" and "ATEN_CPU_CAPABILITY" not in environ
    environ[cpu_isa.ENV] = "avx2"
    cpu_isa.apply_env()
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and environ["ATEN_CPU_CAPABILITY"] == "avx2"
    del environ["ONEDNN_MAX_CPU_ISA"]
    environ[cpu_isa.ENV] = "native"
    cpu_isa.apply_env()
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # the Intel VM's cap, unasked


def test_the_cpuid_level_is_read_from_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        reported = "cpuid level" in f.read()
    assert (cpu_isa.cpuid_level() > 0) is reported


@pytest.mark.slow
def test_a_bf16_vllm_engine_generates_where_the_cpu_lists_amx(tmp_path):
    """vLLM's CPU attention takes its AMX kernel for bf16 when ``torch.cpu`` reports AMX tiles, and
    Linux kills a process that runs AMX without asking for it first (SIGILL in
    ``cpu_attention_with_kv_cache``, measured on a Xeon of model 207). After ``hybridflow.device``
    a process reports AMX only where the tiles are described and permitted, and a bf16 engine
    generates (a fresh process: the switch acts at import)."""
    from hybridflow.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(str(tmp_path / "model"), "qwen2", seed=0)
    code = (
        "import hybridflow.device, torch\n"
        "from hybridflow import cpu_isa\n"
        "amx = torch.cpu._is_amx_tile_supported()\n"
        "assert not (amx and not cpu_isa.amx_tiles_described()), amx\n"
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={model!r}, dtype='bfloat16', enforce_eager=True, max_model_len=64)\n"
        "out = llm.generate([{'prompt_token_ids': [5, 9, 11]}], SamplingParams(max_tokens=4, temperature=0))\n"
        "print('amx', amx, len(out[0].outputs[0].token_ids))\n")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stderr[-3000:]}"
    assert result.stdout.split()[-1] == "4", result.stdout
