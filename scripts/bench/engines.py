"""Benchmark the training engines against a plain single-process PyTorch loop at equal compute.

Measured, on one model and one batch (every token real, so no path can skip padding):

- ``plain_2threads``: HF model, whole batch, one process with 2 intra-op threads: a textbook
  forward -> response-token NLL -> backward -> clip -> AdamW step.
- ``plain_1thread_half_solo``: the same loop on half the batch with 1 thread (one rank's work),
  alone; ``plain_1thread_half_pair``: two such processes at once, no communication (ideal DP).
- ``fsdp_dp2``: FSDPEngine, 2 ranks x 1 thread, half the batch each, parameters sharded (fsdp_size -1).
- ``fsdp_dp2_replicated``: the same with ``fsdp_size=1`` (each rank holds the model; DDP all-reduce,
  through shared memory after backward where vLLM's CPU kernels are). ``--gloo-too`` adds
  ``fsdp_dp2_replicated_gloo`` (``HYBRIDFLOW_SHM_COLLECTIVES=0``: DDP's own all-reduce on gloo) and
  ``speedup_vs_gradients_on_gloo``.
- ``megatron_tp2`` / ``megatron_pp2``: MegatronEngine, 2 ranks x 1 thread, the whole batch
  (dp=1); PP splits it into ``--pp-micro-batches`` micro-batches for the 1F1B schedule.
- ``torch_fsdp2`` / ``torch_ddp`` / ``torch_tp`` / ``torch_pp``: each engine layout written by hand
  with PyTorch's own parallel APIs (``_plain_pytorch_layouts.py``), 2 ranks x 1 thread, the same
  rows per rank as the engine it pairs with: the equal-work baseline of the framework overhead.
- ``--lora-too R``: ``fsdp_dp2_lora`` / ``fsdp_dp2_lora_replicated``, both FSDP layouts with rank-R
  LoRA adapters on every linear layer; ``speedup_vs_full_fine_tuning`` compares each with its
  full fine-tuning layout in the same rounds.

Engines train through ``train_batch`` with the SFT worker's NLL loss. All groups are started once
and stay alive; the parent then runs ``--rounds`` rounds, each giving every measurement
``--steps`` timed steps in a rotating order, so load from other processes on a shared machine hits
all of them alike. Overheads are medians of per-round throughput ratios.

    python scripts/bench/engines.py --out engines.json
"""
from __future__ import annotations

import argparse
import json
import os
import queue as queue_lib
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridflow import device as hf_device  # noqa: E402  (sets oneDNN's ISA cap before any math)
from hybridflow.ports import free_rendezvous_port  # noqa: E402
from hybridflow.tiny import TINY_ARCHS  # noqa: E402

GOAL_MAX_OVERHEAD = 0.10
GOAL_METRIC = "vs_same_layout_in_plain_pytorch"
# engine -> the same layout written by hand in plain PyTorch (_plain_pytorch_layouts.py)
SAME_LAYOUT = {"fsdp_dp2": "torch_fsdp2", "fsdp_dp2_replicated": "torch_ddp",
               "megatron_tp2": "torch_tp", "megatron_pp2": "torch_pp"}
COMPARISON = (
    "All configurations use the same 2 CPU cores and the same global batch; tokens_per_s counts every "
    "(prompt + response) token of the global batch per median wall-clock step; overhead = 1 - "
    "engine/baseline tokens/s, the median of per-round ratios (rounds interleave all configurations, "
    "so load drifting between rounds cancels). Engines run 2 ranks x 1 thread; each rank owns one core "
    "and half the FLOPs (FSDP: half the rows; TP: half of every matmul; PP: half the layers). "
    "The goal (< 10% framework overhead) is judged against vs_same_layout_in_plain_pytorch: the engine's own "
    "parallel layout written by hand with PyTorch's parallel APIs (fully_shard, DistributedDataParallel, "
    "DTensor parallelize_module with the Megatron column/row plan, torch.distributed.pipelining Schedule1F1B), "
    "same model, rows, loss, clipping and fused AdamW, same ranks and threads, so both sides pay the layout's "
    "communication and bubble and the difference is the framework. "
    "vs_plain_1thread_half_pair is the cost of the layout itself on this host: two plain HF loops, 1 thread and half "
    "the batch each, run at the same time with no communication, i.e. perfect data parallelism with the "
    "same process/thread layout and the same CPU contention as the engines; what the engines lose "
    "against it is communication, waiting, pipeline bubble and bookkeeping (on a CPU, TP's and PP's messages cross "
    "TCP loopback, which the framework cannot remove). vs_plain_2threads compares "
    "with one process x 2 OpenMP threads on the whole batch (the literal single-process loop); it is "
    "only meaningful on a quiet machine, since OpenMP's 2-thread barriers collapse when the cores are "
    "oversubscribed. per_rank_vs_plain_1thread_half_solo compares per-rank tokens/s (global/2) with one "
    "plain 1-thread loop on half the batch running alone. cpu_time_vs_plain_1thread_half_pair compares "
    "CPU-seconds per global batch (all ranks, all threads): extra work the framework does, excluding "
    "time a rank sits idle waiting for its peer or in the pipeline bubble; it is the most load-robust "
    "number on a shared machine. Memory per rank: peak_memory_bytes is hybridflow.device.peak_memory_bytes() "
    "(GPU: max allocated; CPU: ru_maxrss, which a spawned process inherits from its parent, so it is "
    "a floor); peak_rss_bytes (CPU, /proc VmHWM) is the process's own peak and "
    "rss_after_imports_bytes its resident size once libraries are imported, so their difference "
    "is the model, optimizer, activations and communication buffers.")


# ---------------------------------------------------------------------------------- the workload
def make_batch(rows: int, prompt_len: int, resp_len: int, vocab: int, seed: int = 0):
    """Fully real prompts and responses (no padding): every path computes exactly the same tokens."""
    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt_len + resp_len), generator=gen)
    mask = torch.ones_like(ids)
    position_ids = torch.arange(prompt_len + resp_len).expand(rows, -1).clone()
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
        "prompts": ids[:, :prompt_len].clone(), "responses": ids[:, prompt_len:].clone(),
        "response_mask": mask[:, prompt_len:].clone()}, meta_info={"temperature": 1.0})


def engine_config(args, strategy: str, tp: int, pp: int, micro_rows: int):
    from workers.engines.config import EngineConfig

    return EngineConfig(strategy=strategy, tp=tp, pp=pp, lr=args.lr, weight_decay=0.01, grad_clip=1.0,
                        micro_batch_size_per_gpu=micro_rows, param_dtype=args.dtype, seed=0)


def plain_step_fn(args, data, device):
    """The single-process reference loop: HF model, one forward over the whole (share of the) batch."""
    import _plain_pytorch_layouts as layouts

    return layouts.single_process_step_fn(args.ckpt, data.to(device).batch, device, args.lr, args.dtype == "bf16")


def rows_of(data, rank: int, ranks: int):
    """Rank ``rank``'s equal share of the batch's rows."""
    share = len(data) // ranks
    return data[rank * share:(rank + 1) * share]


def nll_loss_fn(outputs, micro):
    """workers/sft_worker.py's loss (response-token NLL, token mean over the whole mini-batch),
    restated here so the benchmark does not import the controller stack."""
    from workers.engines.base import mini_batch_token_mean

    mask = micro.batch["response_mask"].to(outputs["log_probs"].dtype)
    return mini_batch_token_mean(-outputs["log_probs"], mask, micro), {}


def import_for(group: str) -> None:
    """Import what ``group`` needs before its start-up memory is read (imports are not training)."""
    import transformers  # noqa: F401
    if group.startswith("fsdp_dp2"):
        import workers.engines.fsdp  # noqa: F401
    elif group.startswith("megatron"):
        import workers.engines.megatron  # noqa: F401


def engine_step_fn(args, kind: str, data):
    if kind.startswith("fsdp_dp2"):
        from dataclasses import replace

        from workers.engines.fsdp import FSDPEngine

        config = engine_config(args, "fsdp", 1, 1, args.rows // 2)
        if kind == "fsdp_dp2_replicated":
            config = replace(config, fsdp_size=1)
        elif kind == NO_PREFETCH:
            config = replace(config, forward_prefetch=False)
        elif kind == KEEP_GATHERED:
            config = replace(config, reshard_after_forward=False)
        elif kind.startswith(LORA):  # LORA (sharded) or LORA + "_replicated"
            config = replace(config, lora_rank=args.lora_too, lora_alpha=2.0 * args.lora_too,
                             fsdp_size=1 if kind.endswith("_replicated") else -1)
        engine = FSDPEngine(config, args.ckpt, "actor")
    elif kind == "megatron_tp2":
        from workers.engines.megatron import MegatronEngine

        engine = MegatronEngine(engine_config(args, "megatron", 2, 1, args.rows), args.ckpt, "actor")
    elif kind == "megatron_pp2":
        from workers.engines.megatron import MegatronEngine

        micro = args.rows // args.pp_micro_batches
        engine = MegatronEngine(engine_config(args, "megatron", 1, 2, micro), args.ckpt, "actor")
    else:
        raise ValueError(f"unknown engine {kind!r}")
    mine = rows_of(data, engine.dp_rank, engine.dp_size)
    return lambda: engine.train_batch(mine, nll_loss_fn)


def layout_step_fn(args, layout: str, data, rank: int, device):
    """The engine's layout in plain PyTorch; data-parallel layouts take their half of the rows."""
    import _plain_pytorch_layouts as layouts

    bf16 = args.dtype == "bf16"
    if layout == "fsdp2":
        return layouts.fsdp2_step_fn(args.ckpt, rows_of(data, rank, 2).to(device).batch, device, args.lr, bf16)
    if layout == "ddp":
        return layouts.ddp_step_fn(args.ckpt, rows_of(data, rank, 2).to(device).batch, device, args.lr, bf16)
    batch = data.to(device).batch
    if layout == "tp":
        return layouts.tp_step_fn(args.ckpt, batch, device, args.lr, bf16)
    return layouts.pp_step_fn(args.ckpt, batch, device, args.lr, args.pp_micro_batches, bf16)


# ---------------------------------------------------------------------------------- worker processes
def _proc_status_bytes(key: str) -> int | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from /proc (Linux), else None.

    Needed next to hybridflow.device.peak_memory_bytes() on CPU: that reads ru_maxrss, which a
    spawned child inherits from its parent across fork+exec, so it never reads below the parent's
    peak; VmHWM belongs to the child's own address space.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _worker(group: str, rank: int, world: int, port: int, threads: int, args, cmd_q, res_q):
    try:
        torch.set_num_threads(threads)
        if group.endswith(SHM_SUFFIX):  # the same engine with hybridflow/shm_group.py on
            os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = "1"
        if group.endswith(GLOO_SUFFIX):  # ... and off: DDP's own gradient all-reduce on gloo
            os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = "0"
        if group.startswith(("fsdp", "megatron", "torch_")):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            hf_device.init_distributed(timeout_s=600)
        import_for(group)
        rss_start = _proc_status_bytes("VmRSS")
        device = hf_device.torch_device(rank if hf_device.device_type() == "cuda" else None)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.ckpt).vocab_size
        data = make_batch(args.rows, args.prompt, args.response, vocab)
        if group == "plain_2threads":
            step = plain_step_fn(args, data, device)
        elif group == "plain_1thread_half":
            step = plain_step_fn(args, rows_of(data, rank, 2), device)
        elif group.startswith("torch_"):
            step = layout_step_fn(args, group.removeprefix("torch_"), data, rank, device)
        else:
            step = engine_step_fn(args, group.removesuffix(SHM_SUFFIX).removesuffix(GLOO_SUFFIX), data)
        for _ in range(args.warmup):
            step()
        hf_device.synchronize()
        res_q.put((group, rank, "ready", None))
        while (n := cmd_q.get()) is not None:
            times = []  # (wall seconds, CPU seconds of this process, all its threads) per step
            for _ in range(n):
                start, cpu = time.perf_counter(), time.process_time()
                step()
                hf_device.synchronize()
                times.append((time.perf_counter() - start, time.process_time() - cpu))
            res_q.put((group, rank, "times", times))
        res_q.put((group, rank, "memory", {"peak_memory_bytes": hf_device.peak_memory_bytes(),
                                           "peak_rss_bytes": _proc_status_bytes("VmHWM"),
                                           "rss_after_imports_bytes": rss_start}))
    except BaseException:
        res_q.put((group, rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


ENGINE_GROUPS = ("fsdp_dp2", "fsdp_dp2_replicated", "megatron_tp2", "megatron_pp2")
# --shm-too: these engines again with HYBRIDFLOW_SHM_COLLECTIVES=1 (hybridflow/shm_group.py on)
SHM_SUFFIX = "_shm"
SHM_TOO = ("megatron_tp2",)  # opt-in there; the replicated FSDP layout's gradients use it by default
# --gloo-too: the replicated FSDP layout again with HYBRIDFLOW_SHM_COLLECTIVES=0 (DDP's own gradient
# all-reduce over gloo, overlapped with backward, instead of shared memory after it)
GLOO_SUFFIX = "_gloo"
GLOO_TOO = ("fsdp_dp2_replicated",)
# --no-prefetch-too: sharded FSDP again with each all-gather blocking where it is needed
NO_PREFETCH = "fsdp_dp2_no_prefetch"
# --keep-gathered-too: sharded FSDP again with fsdp_config.reshard_after_forward=false
KEEP_GATHERED = "fsdp_dp2_keep_gathered"
# --lora-too R: both FSDP layouts again with rank-R LoRA adapters on every linear layer (all-linear)
LORA = "fsdp_dp2_lora"
# group -> (processes, threads per process)
GROUPS = {"plain_2threads": (1, 2), "plain_1thread_half": (2, 1),
          **{g: (2, 1) for g in ENGINE_GROUPS}, **{g: (2, 1) for g in SAME_LAYOUT.values()}}
# measurement -> (group, ranks that run)
MEASUREMENTS = {"plain_2threads": ("plain_2threads", (0,)),
                "plain_1thread_half_solo": ("plain_1thread_half", (0,)),
                "plain_1thread_half_pair": ("plain_1thread_half", (0, 1)),
                **{g: (g, (0, 1)) for g in ENGINE_GROUPS}, **{g: (g, (0, 1)) for g in SAME_LAYOUT.values()}}


def _free_port() -> int:
    return free_rendezvous_port("127.0.0.1")


class Fleet:
    """Every group's processes, alive for the whole run, each waiting on its own command queue."""

    def __init__(self, args):
        ctx = mp.get_context("spawn")
        self.res_q = ctx.Queue()
        self.cmd, self.procs, self.timeout = {}, [], args.timeout
        for group, (world, threads) in GROUPS.items():
            port = _free_port()
            for rank in range(world):
                q = ctx.Queue()
                self.cmd[group, rank] = q
                p = ctx.Process(target=_worker, args=(group, rank, world, port, threads, args, q, self.res_q))
                p.start()
                self.procs.append(p)

    def _collect(self, expected: set, kind: str) -> dict:
        got, deadline = {}, time.monotonic() + self.timeout
        while len(got) < len(expected):
            try:
                group, rank, status, value = self.res_q.get(timeout=1.0)
            except queue_lib.Empty:
                dead = [p.name for p in self.procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark worker died or hung (dead: {dead}) waiting for {kind}")
                continue
            if status == "error":
                raise RuntimeError(f"{group} rank {rank} failed:\n{value}")
            if status != kind:
                raise RuntimeError(f"{group} rank {rank}: expected {kind!r}, got {status!r}")
            got[group, rank] = value
        return got

    def wait_ready(self, timeout: float) -> None:
        """Start-up (imports, model load, warm-up steps) of all groups at once: slow on 2 cores."""
        self.timeout, per_step = timeout, self.timeout
        self._collect(set(self.cmd), "ready")
        self.timeout = per_step

    def run(self, group: str, ranks: tuple[int, ...], steps: int) -> dict[int, list[float]]:
        for r in ranks:
            self.cmd[group, r].put(steps)
        return {r: v for (_, r), v in self._collect({(group, r) for r in ranks}, "times").items()}

    def close(self) -> dict:
        for q in self.cmd.values():
            q.put(None)
        memory = self._collect(set(self.cmd), "memory")
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        return memory

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------------- analysis
def throughput(name: str, times: dict[int, list], tokens_per_step: int) -> float:
    """Global tokens/s of one measurement from per-rank wall times."""
    walls = {r: [w for w, _ in t] for r, t in times.items()}
    if name == "plain_1thread_half_pair":  # independent processes: their throughputs add up
        return sum(tokens_per_step / 2 / statistics.median(w) for w in walls.values())
    if name == "plain_1thread_half_solo":
        return tokens_per_step / 2 / statistics.median(walls[0])
    # synchronised ranks: a step lasts as long as its slowest rank
    return tokens_per_step / statistics.median([max(ws) for ws in zip(*walls.values())])


def cpu_seconds(name: str, times: dict[int, list]) -> float:
    """CPU seconds (all ranks, all threads) spent per global batch; waiting for a peer costs none."""
    per_rank = [statistics.median(c for _, c in t) for t in times.values()]
    return 2 * per_rank[0] if name == "plain_1thread_half_solo" else sum(per_rank)


def same_layout_of(engine: str) -> str | None:
    """The plain-PyTorch twin of an engine measurement (None for LoRA, which does less work)."""
    if engine.startswith(LORA):
        return None
    base = engine.removesuffix(SHM_SUFFIX).removesuffix(GLOO_SUFFIX)
    return SAME_LAYOUT["fsdp_dp2" if base in (NO_PREFETCH, KEEP_GATHERED) else base]


MEMORY_KEYS = ("peak_memory_bytes", "peak_rss_bytes", "rss_after_imports_bytes")


def summarise(args, rounds: list[dict], memory: dict) -> dict:
    tokens = args.rows * (args.prompt + args.response)
    wall = [{m: throughput(m, t, tokens) for m, t in r.items()} for r in rounds]
    cpu = [{m: cpu_seconds(m, t) for m, t in r.items()} for r in rounds]

    def median_over_rounds(per_round, name):
        return statistics.median(r[name] for r in per_round)

    def overhead(engine, base, per_rank=False):  # 1 - engine/base throughput, median of per-round ratios
        return 1 - statistics.median(r[engine] / (2 if per_rank else 1) / r[base] for r in wall)

    def cpu_overhead(engine, base):  # CPU-time throughput: tokens per CPU-second
        return 1 - statistics.median(r[base] / r[engine] for r in cpu)

    def mem(group):
        world = GROUPS[group][0]
        return {k: [memory[group, r][k] for r in range(world)] for k in MEMORY_KEYS}

    baselines = {}
    for name in ("plain_2threads", "plain_1thread_half_solo", "plain_1thread_half_pair"):
        group = MEASUREMENTS[name][0]
        baselines[name] = {"tokens_per_s": round(median_over_rounds(wall, name), 1),
                           "cpu_s_per_step": round(median_over_rounds(cpu, name), 3),
                           "threads_per_process": GROUPS[group][1], "processes": len(MEASUREMENTS[name][1]),
                           "rows_per_process": args.rows if group == "plain_2threads" else args.rows // 2,
                           **mem(group)}
    same_layout = {}  # the layouts in plain PyTorch: what the layout alone costs on this host
    for name in SAME_LAYOUT.values():
        same_layout[name] = {"tokens_per_s": round(median_over_rounds(wall, name), 1),
                             "cpu_s_per_step": round(median_over_rounds(cpu, name), 3),
                             "vs_plain_1thread_half_pair": round(overhead(name, "plain_1thread_half_pair"), 3),
                             **mem(name)}
    engines = {}
    for name in [m for m in MEASUREMENTS if m.startswith(("fsdp", "megatron"))]:
        tps = median_over_rounds(wall, name)
        twin = same_layout_of(name)
        over = {**({GOAL_METRIC: overhead(name, twin), "cpu_time_vs_same_layout_in_plain_pytorch":
                    cpu_overhead(name, twin)} if twin else {}),
                "vs_plain_2threads": overhead(name, "plain_2threads"),
                "per_rank_vs_plain_1thread_half_solo": overhead(name, "plain_1thread_half_solo", True),
                "vs_plain_1thread_half_pair": overhead(name, "plain_1thread_half_pair"),
                "cpu_time_vs_plain_1thread_half_pair": cpu_overhead(name, "plain_1thread_half_pair")}
        engines[name] = {"tokens_per_s": round(tps, 1), "tokens_per_s_per_rank": round(tps / 2, 1),
                         "median_step_s": round(tokens / tps, 4),
                         "cpu_s_per_step": round(median_over_rounds(cpu, name), 3),
                         "overhead": {k: round(v, 3) for k, v in over.items()}, **mem(name)}
    if NO_PREFETCH in engines:  # same run, same rounds: the speed-up of the one-layer-ahead gathers
        engines["fsdp_dp2"]["speedup_vs_no_prefetch"] = round(
            statistics.median(r["fsdp_dp2"] / r[NO_PREFETCH] for r in wall), 3)
    for name, full in ((LORA, "fsdp_dp2"), (LORA + "_replicated", "fsdp_dp2_replicated")):
        if name in engines:  # same run, same rounds: adapters only (no frozen weight's gradient matmul)
            engines[name]["speedup_vs_full_fine_tuning"] = round(
                statistics.median(r[name] / r[full] for r in wall), 3)
            engines[name]["lora_rank"] = args.lora_too
    for name in GLOO_TOO:  # same run, same rounds: gradients through shared memory after backward vs gloo
        if name + GLOO_SUFFIX in engines:
            engines[name]["speedup_vs_gradients_on_gloo"] = round(
                statistics.median(r[name] / r[name + GLOO_SUFFIX] for r in wall), 3)
    if KEEP_GATHERED in engines:  # same run, same rounds: one all-gather per layer per step
        engines[KEEP_GATHERED]["speedup_vs_fsdp_dp2"] = round(
            statistics.median(r[KEEP_GATHERED] / r["fsdp_dp2"] for r in wall), 3)
    pp_m = args.pp_micro_batches
    engines["megatron_pp2"]["micro_batches"] = pp_m
    engines["megatron_pp2"]["ideal_1f1b_bubble_fraction"] = round(1 / (pp_m + 1), 3)  # (p-1)/(m+p-1), p=2
    engines["megatron_tp2"]["micro_batches"] = 1
    engines["fsdp_dp2"]["micro_batches"] = engines["fsdp_dp2_replicated"]["micro_batches"] = 1
    return {
        "model": {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "intermediate": args.intermediate, "dtype": args.dtype},
        "batch": {"rows": args.rows, "prompt_tokens": args.prompt, "response_tokens": args.response,
                  "tokens_per_step": tokens, "loss": "response-token NLL (token mean), AdamW, grad clip 1.0"},
        "machine": {"device": hf_device.device_type(), "cpu_count": os.cpu_count(),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "timing": {"warmup_steps": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps},
        "comparison": COMPARISON,
        "baselines": baselines,
        "same_layout_in_plain_pytorch": same_layout,
        "engines": engines,
        "per_round_tokens_per_s": [{k: round(v, 1) for k, v in r.items()} for r in wall],
        "goal": {"max_overhead": GOAL_MAX_OVERHEAD, "judged_on": GOAL_METRIC,
                 "met": {n: engines[n]["overhead"][GOAL_METRIC] < GOAL_MAX_OVERHEAD for n in ENGINE_GROUPS},
                 "met_even_against_ideal_data_parallelism": {
                     n: engines[n]["overhead"]["vs_plain_1thread_half_pair"] < GOAL_MAX_OVERHEAD
                     for n in ENGINE_GROUPS}},
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen2", choices=TINY_ARCHS)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8, help="global batch rows (even; divisible by --pp-micro-batches)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--pp-micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: the engines' param_dtype=bf16 against the plain loop under bf16 autocast")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement per round")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one measurement")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for all groups to start")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--shm-too", action="store_true",
                   help=f"also run {', '.join(SHM_TOO)} with HYBRIDFLOW_SHM_COLLECTIVES=1")
    p.add_argument("--gloo-too", action="store_true",
                   help=f"also run {', '.join(GLOO_TOO)} with HYBRIDFLOW_SHM_COLLECTIVES=0 (gradients on gloo)")
    p.add_argument("--no-prefetch-too", action="store_true",
                   help=f"also run sharded FSDP with fsdp_config.forward_prefetch=false ({NO_PREFETCH})")
    p.add_argument("--keep-gathered-too", action="store_true",
                   help=f"also run sharded FSDP with fsdp_config.reshard_after_forward=false ({KEEP_GATHERED})")
    p.add_argument("--lora-too", type=int, default=0, metavar="RANK",
                   help=f"also run both FSDP layouts with rank-RANK LoRA adapters ({LORA}, {LORA}_replicated)")
    args = p.parse_args(argv)
    variants = [(group, "fsdp_dp2") for group in (LORA, LORA + "_replicated") if args.lora_too]
    variants += [(group, "fsdp_dp2") for flag, group in ((args.no_prefetch_too, NO_PREFETCH),
                                                         (args.keep_gathered_too, KEEP_GATHERED)) if flag]
    variants += [(g + SHM_SUFFIX, g) for g in SHM_TOO if args.shm_too]
    variants += [(g + GLOO_SUFFIX, g) for g in GLOO_TOO if args.gloo_too]
    for group, like in variants:  # another setting of an engine: its processes and ranks
        GROUPS[group] = GROUPS[like]
        MEASUREMENTS[group] = (group, MEASUREMENTS[like][1])
    if args.rows % 2 or args.rows % args.pp_micro_batches:
        p.error(f"--rows={args.rows} must be even and divisible by --pp-micro-batches={args.pp_micro_batches}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from hybridflow.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt = make_tiny_checkpoint(os.path.join(tmp, "model"), arch=args.arch, tied=False, hidden=args.hidden,
                                         layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                         intermediate=args.intermediate)
        fleet = Fleet(args)
        try:
            fleet.wait_ready(args.startup_timeout)
            names = list(MEASUREMENTS)
            rounds = []
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]  # rotate: no fixed position
                rounds.append({m: fleet.run(*MEASUREMENTS[m], args.steps) for m in order})
            memory = fleet.close()
        except BaseException:
            fleet.kill()
            raise
    result = summarise(args, rounds, memory)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
