"""e2e.py's ``--best-precision``: ours / TRL at equal work, each side at its best precision on the CPU in
hand, and which CPU that was (issue 38).

Equal work: beta 0 with every row computed (``actor.skip_zero_advantage=false``), the same prompts,
samples, lengths and steps. Best precision: what ``param_dtype=auto`` picks here (bf16 where a timed
bf16 matmul beats fp32 by 1.5x, else fp32) for both, TRL in bf16 autocast (``--bf16``) when that is
bf16; with ``--both-dtypes`` both dtypes of both sides are measured and each side's faster one is
taken. Best attention likewise: ``--attention sdpa,eager`` (the default here) runs each side with
transformers' SDPA (torch's flash kernel on a CPU) and with its eager attention (ours through
``+actor_rollout_ref.model.override_config.attn_implementation=eager``, TRL through the model it
is given, as ``model_init_kwargs`` would build it) and takes each side's faster setting. Runs are
interleaved (ours, TRL, ours again with ``--repeat``) so a shared machine's load falls on both;
the spread of the repeats is printed beside the ratio, and the ratio at each shared setting
(``ratio_same_setting``) beside the best-against-best one.
"""
from __future__ import annotations

import os
import statistics

from hybridflow.cpu_isa import ENV as ISA_ENV
from hybridflow.cpu_isa import cpu_model_and_flags

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
EQUAL_WORK = ("actor_rollout_ref.actor.skip_zero_advantage=false",)
ATTENTION_KEY = "+actor_rollout_ref.model.override_config.attn_implementation"


def cpu_in_hand() -> dict:
    """The CPU's model, the ISA flags that decide its kernels, and the HYBRIDFLOW_CPU_ISA switch
    (avx2: this CPU runs oneDNN's and ATen's AVX2 code, as an AVX2-only machine does)."""
    model, flags = cpu_model_and_flags()
    forced = os.environ.get(ISA_ENV, "native") or "native"
    present = [f for f in ISA_FLAGS if f in flags]
    effective = ["avx2", "fma"] if forced == "avx2" else present
    return {"model": model, "flags": present, ISA_ENV: forced, "runs_as": effective}


def best_precision_runs(args, auto_dtype: str) -> list[tuple[str, str, str]]:
    """(side, dtype, attention) of our runs and TRL's: the auto dtype, or both with --both-dtypes,
    times the attentions of --attention."""
    dtypes = ("fp32", "bf16") if args.both_dtypes else (auto_dtype,)
    return [(side, d, a) for d in dtypes for a in args.attention for side in ("hybridflow", "trl")]


def run_equal_work(args, paths: dict, size: str, run_ours, run_trl) -> dict:
    """``args.repeat`` rounds of every (side, dtype, attention) run, interleaved, then :func:`summarise`."""
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        for side, dtype, attn in best_precision_runs(args, args.auto_dtype):
            if side == "hybridflow":
                extra = (*EQUAL_WORK, f"actor_rollout_ref.actor.param_dtype={dtype}")
                extra += (f"{ATTENTION_KEY}={attn}",) if attn != "sdpa" else ()  # sdpa: the default, as before
                result = run_ours(args, paths, size, "beta0", extra, f"-equal-{dtype}-{attn}-{rep}")
            else:
                result = run_trl(args, paths, size, "beta0",
                                 (*(("--bf16",) if dtype == "bf16" else ()), "--attn-implementation", attn))
            runs.setdefault(f"{side}_{dtype}_{attn}", []).append(result)
    out = summarise(runs, args.auto_dtype, cpu_in_hand())
    out["runs"] = {k: [{f: r.get(f) for f in ("step_s", "timing_s", "train_s", "gen_s", "auto_choices", "error",
                                                 "log_tail") if r.get(f) is not None} for r in v]
                   for k, v in runs.items()}
    return out


def summarise(runs: dict[str, list[dict]], auto_dtype: str, cpu: dict) -> dict:
    """``runs``: "hybridflow_fp32_sdpa" | "trl_bf16_eager" ... (no attention: sdpa) -> the
    repeats' results. Each side's best setting by its median step, the ratio at equal work, the
    spread of the repeats, and the ratio at each setting both sides ran."""
    def med(results):
        steps = [r["step_s"] for r in results if r.get("step_s")]
        return (statistics.median(steps), steps) if steps else (None, [])

    best, settings = {}, {}
    for key, results in runs.items():
        side, dtype, *attn = key.split("_")
        m = med(results)
        if m[0]:
            settings.setdefault(side, {})[(dtype, attn[0] if attn else "sdpa")] = m
    for side, by_setting in settings.items():
        dtype, attn = min(by_setting, key=lambda d: by_setting[d][0])
        best[side] = {"dtype": dtype, "attn_implementation": attn, "step_s": round(by_setting[dtype, attn][0], 4),
                      "repeats_s": [round(s, 3) for s in by_setting[dtype, attn][1]]}
    out = {"param_dtype_auto_here": auto_dtype, "best": best}
    shared = sorted(set(settings.get("hybridflow", {})) & set(settings.get("trl", {})))
    if len(shared) > 1:
        out["ratio_same_setting"] = {f"{d}/{a}": round(settings["hybridflow"][d, a][0] / settings["trl"][d, a][0], 3)
                                     for d, a in shared}
    if len(best) == 2:
        ours, trl = best["hybridflow"], best["trl"]
        out["ratio_to_trl_best_precision"] = round(ours["step_s"] / trl["step_s"], 3)
        ratios = [o / t for o, t in zip(ours["repeats_s"], trl["repeats_s"])]
        if len(ratios) > 1:
            out["ratio_per_repeat"] = [round(r, 3) for r in ratios]
        out["goal"] = 0.7 if "avx512_bf16" in cpu["runs_as"] or "amx_bf16" in cpu["runs_as"] else 0.8
    return out
