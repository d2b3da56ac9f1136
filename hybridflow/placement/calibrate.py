"""A short profiling pass on the machine in hand: the DeviceProfile of one CPU worker slot,
whose ``measured`` rates replace the cost model's peak x efficiency (hybridflow/placement/cost.py).

On a GPU the cost model's datasheet peaks times an efficiency are good enough; on a CPU the
efficiency of a whole model's forward or training step is far from a matmul's (attention, norms,
the LM head's softmax, the optimizer, threads), so the most predictive numbers are the actual
model's: its forward, its forward+backward+AdamW step and its one-token decode step, each timed
at the workload's sizes and expressed as an effective FLOP/s (2N per token forward, 6N per token
train: Kaplan et al. 2020, arXiv:2001.08361 section 2.1), so the cost model applies them to any
role and batch. Besides: matmul FLOP/s per dtype, the gloo all-reduce between 2 local processes
(fixed latency per call and bus bandwidth) and a memory copy's bandwidth.

Everything runs with ``threads`` torch threads (a worker's share of the cores), best of a few
repeats (a shared machine only ever makes a run slower), in under ~30 s, and is cached as JSON in
``~/.cache/hybridflow/`` under a key of the CPU model and flags, torch's version, the thread
count and the model shapes measured: a new machine, torch or model size measures again.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

from hybridflow.placement.devices import DeviceProfile
from hybridflow.placement.workload import ModelShape, Workload
from hybridflow.ports import free_rendezvous_port

CACHE_VERSION = 3
DTYPES = ("fp32", "bf16")
MAX_MICRO = 64
CACHE_DIR_ENV = "HYBRIDFLOW_CACHE_DIR"


def cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hybridflow")


def cpu_identity() -> str:
    """The CPU's model name and feature flags (what decides its kernels' speed), from /proc/cpuinfo."""
    from hybridflow.cpu_isa import cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    return f"{model or platform.processor() or platform.machine()}|{' '.join(sorted(flags))}"


def cache_key(threads: int, shape: ModelShape, batch: dict) -> str:
    """What the measurements depend on: CPU model and flags (and the ISA switch), torch version, threads per slot, and
    the model shape and batch sizes the per-token rates were measured at."""
    import torch

    # HYBRIDFLOW_CPU_ISA=avx2 runs this CPU's AVX2 kernels, and a oneDNN cap keeps AMX off: other
    # rates, so another entry
    ident = json.dumps({"v": CACHE_VERSION, "cpu": cpu_identity(), "isa": os.environ.get("HYBRIDFLOW_CPU_ISA", ""),
                        "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                        "torch": torch.__version__, "threads": threads,
                        "shape": asdict(shape), "batch": batch}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cache_path(key: str) -> str:
    return os.path.join(cache_dir(), f"calibration-{key}.json")


def profile_from_dict(d: dict) -> DeviceProfile:
    return DeviceProfile(name=d["name"], flops=dict(d["flops"]), mem_bytes=d["mem_bytes"], mem_bw=d["mem_bw"],
                         intra_node_bw=d["intra_node_bw"], inter_node_bw=d["inter_node_bw"], source=d["source"],
                         measured=dict(d.get("measured") or {}))


# What the cost model should assume on a calibrated CPU slot beyond the measured rates: the measured
# all-reduce bandwidth is already achieved bus bandwidth (no efficiency on top), and a worker of
# one thread cannot hide data-parallel traffic under compute (gloo and the matmuls share its core).
CPU_CONSTANTS = {"comm_eff": 1.0, "dp_overlap": 0.0}


@dataclass
class Calibration:
    """One CPU slot as measured: ``device`` with its ``measured`` rates (see ``measure``), the
    cache file it came from and whether it was read from there."""

    device: DeviceProfile
    path: str = ""
    cached: bool = False

    @property
    def measured(self) -> dict:
        return self.device.measured

    def planner_arg(self) -> dict:
        """What ``planner.plan(..., calibration=)`` takes."""
        return {"device": self.device, "constants": dict(CPU_CONSTANTS)}


def calibrate(workload: Workload, threads: int = 1, *, refresh: bool = False, slots: int = 1,
              log=None) -> Calibration:
    """One worker slot of ``threads`` threads, measured for ``workload``'s actor model (cached;
    ``refresh`` measures again). ``slots`` divides the host's memory among the workers."""
    # the runtime's micro-batch: a CPU's rate grows with the matmuls' size (measured: 270 GFLOP/s training
    # bf16 at 16 x 32 tokens, ~390 at 64 x 32), so it is measured at the size the workers run, up to 64 rows
    micro = max(1, min(workload.micro_batch, MAX_MICRO))
    batch = {"micro": micro, "seq": workload.seq_len, "decode_batch": max(2, min(workload.sequences, 128)),
             "prompt": workload.prompt_len, "dtype": "bf16" if workload.param_bytes == 2 else "fp32"}
    key = cache_key(threads, workload.actor, batch)
    path = cache_path(key)
    if not refresh and os.path.exists(path):
        try:
            with open(path) as f:
                return _finish(json.load(f), slots, path, cached=True)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is measured again
    t0 = time.perf_counter()
    data = measure(workload.actor, batch, threads, log=log)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    data["key"] = key
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # a concurrent run reads a whole file or none
    return _finish(data, slots, path)


def _finish(data: dict, slots: int, path: str, cached: bool = False) -> Calibration:
    """The cached measurements as a Calibration; memory per slot is the host's over ``slots``."""
    d = dict(data["profile"])
    d["mem_bytes"] = host_memory_bytes() / max(1, slots)
    return Calibration(profile_from_dict(d), path, cached)


def host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2 ** 30


def measure(actor: ModelShape, batch: dict, threads: int, log=None) -> dict:
    """Every measurement, at ``threads`` threads; returns the cache file's content."""
    import torch

    say = log or (lambda msg: None)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = {dt: matmul_flops(dt, actor.hidden, actor.ffn, batch["micro"] * batch["seq"]) for dt in DTYPES}
        say(f"matmul FLOP/s {flops}")
        fwd, train, decode_f, step_s = {}, {}, {}, {}
        for dt in DTYPES:  # forward in both: the reward model computes in fp32 beside a bf16 actor
            fwd[dt] = forward_flops(actor, dt, batch["micro"], batch["seq"])
        dt = batch["dtype"]  # training and generation in the workload's dtype only (fp32 training is slow to time)
        train[dt] = train_flops(actor, dt, batch["micro"], batch["seq"])
        decode_f[dt], step_s[dt] = decode_cost(actor, dt, batch["decode_batch"], batch["prompt"])
        say(f"model forward {fwd}, train {train}, decode {decode_f} + {step_s} s/step")
        coll = gloo_collectives(threads)
        say("gloo " + ", ".join(f"{k} {v:.3g}" for k, v in coll.items()))
        mem_bw = copy_bandwidth()
    finally:
        torch.set_num_threads(previous)
    measured = {"fwd_flops": fwd, "train_flops": train, "decode_flops": decode_f,
                # engine overhead per decode step: the dtype the rollout uses is not known here, take the larger
                "decode_step_s": max(step_s.values()), "decode_step_s_by_dtype": step_s,
                **coll, "threads": threads}
    profile = {"name": f"cpu-{threads}t", "flops": flops, "mem_bytes": host_memory_bytes(), "mem_bw": mem_bw,
               "intra_node_bw": coll["all_reduce_bw"], "inter_node_bw": coll["all_reduce_bw"], "measured": measured,
               "source": (f"calibrated {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on "
                          f"{cpu_identity().split('|')[0]}, {threads} thread(s) per slot "
                          "(hybridflow/placement/calibrate.py)")}
    return {"version": CACHE_VERSION, "cpu": cpu_identity().split("|")[0], "torch": torch.__version__,
            "threads": threads, "shape": asdict(actor), "batch": batch,
            "profile": profile}


def _best(fn, repeats: int, budget_s: float) -> float:
    """The fastest of ``repeats`` timed calls (after one untimed warm-up), stopping early past ``budget_s``."""
    fn()
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return best


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def matmul_flops(dtype: str, hidden: int, ffn: int, tokens: int) -> float:
    """FLOP/s of the workload's MLP-shaped matmul (tokens x hidden) @ (hidden x ffn)."""
    import torch

    tokens = max(64, min(tokens, 2048))
    a = torch.randn(tokens, hidden, dtype=_torch_dtype(dtype))
    b = torch.randn(hidden, ffn, dtype=_torch_dtype(dtype))
    t = _best(lambda: torch.mm(a, b), 5, 1.0)
    return 2.0 * tokens * hidden * ffn / t


def _hf_model(shape: ModelShape, dtype: str):
    """A randomly initialised causal LM of ``shape``: Qwen2's layout (the tiny models' and Llama's),
    Qwen3's where the shape has per-head Q/K norms; the shape's head width either way."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if shape.qk_norm else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                     num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                     head_dim=shape.head_dim, vocab_size=shape.vocab, tie_word_embeddings=shape.tied,
                     max_position_embeddings=4096)
    torch.manual_seed(0)
    return model_cls(cfg).to(_torch_dtype(dtype))


def forward_flops(shape: ModelShape, dtype: str, micro: int, seq: int) -> float:
    """Effective FLOP/s of the model's forward (2N/token, no grad; log-softmax over the logits as the
    log-prob passes do) on ``micro`` sequences of ``seq`` tokens."""
    import torch

    model = _hf_model(shape, dtype)
    ids = torch.randint(0, shape.vocab, (micro, seq))
    with torch.no_grad():
        t = _best(lambda: model(input_ids=ids).logits.float().log_softmax(-1), 3, 1.5)
    return 2.0 * shape.params * micro * seq / t


def train_flops(shape: ModelShape, dtype: str, micro: int, seq: int) -> float:
    """Effective FLOP/s of one training step (forward + backward + AdamW, 6N/token) on ``micro``
    sequences of ``seq`` tokens: the update of a worker whose mini-batch is one micro-batch."""
    import torch

    model = _hf_model(shape, dtype)
    ids = torch.randint(0, shape.vocab, (micro, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step():
        logits = model(input_ids=ids).logits.float()
        logits.log_softmax(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = _best(step, 2, 3.0)
    return 6.0 * shape.params * micro * seq / t


def decode_cost(shape: ModelShape, dtype: str, batch: int, prompt: int) -> tuple[float, float]:
    """One-token decode steps with a KV cache: (effective FLOP/s of the batch-proportional part,
    fixed seconds per step), from steps timed at ``batch`` and at ``batch // 8`` sequences."""
    import torch

    model = _hf_model(shape, dtype)
    n = shape.params

    def step_time(b: int) -> float:
        ids = torch.randint(0, shape.vocab, (b, max(1, prompt)))
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            past, nxt = out.past_key_values, torch.randint(0, shape.vocab, (b, 1))
            times = []
            for _ in range(6):
                t = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                times.append(time.perf_counter() - t)
                past = out.past_key_values
        return min(times[1:])

    big, small = max(2, batch), max(1, batch // 8)
    t_big, t_small = step_time(big), step_time(small)
    per_seq = max((t_big - t_small) / (big - small), 1e-9)
    fixed = max(t_big - per_seq * big, 0.0)
    return 2.0 * n / per_seq, fixed


def copy_bandwidth() -> float:
    """Bytes/s of a 64 MB tensor copy (read + write counted)."""
    import torch

    src = torch.empty(16 * 2 ** 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _best(lambda: dst.copy_(src), 5, 1.0)
    return 2.0 * src.numel() * 4 / t


def _collectives_rank(rank: int, port: int, threads: int, numel: int, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        small, big = torch.ones(256), torch.ones(numel)
        gathered, shard = torch.empty(2 * numel), torch.empty(numel // 2)
        calls = {"latency": (lambda: dist.all_reduce(small), 30),
                 "all_reduce": (lambda: dist.all_reduce(big), 4),
                 "all_gather": (lambda: dist.all_gather_into_tensor(gathered, big), 4),
                 "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, big), 4)}
        results = {}
        for name, (fn, reps) in calls.items():
            fn()
            best = float("inf")
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            results[name] = best
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def gloo_collectives(threads: int) -> dict:
    """Between 2 local processes over gloo, as the workers' collectives run on CPU: seconds of an
    all-reduce of a few bytes (``collective_latency_s``) and the bus bandwidth (bytes each rank
    moves per second: (n-1)/n of the buffer for all-gather and reduce-scatter, 2(n-1)/n for a ring
    all-reduce, i.e. 1x and 1/2x at n = 2) of a 16 MB all-reduce, all-gather and reduce-scatter.
    gloo's all-gather and reduce-scatter run at a fraction of its all-reduce's rate here, which is
    what sharded FSDP pays against replicated (DDP) on a CPU host."""
    import multiprocessing as mp
    import warnings

    # spawn, not fork: a process forked after OpenMP started its threads (calibrating at 2+ threads)
    # hangs in its first parallel region (seen: 90 s, then queue.Empty)
    ctx = mp.get_context("spawn")
    numel = 4 * 2 ** 20  # fp32: 16 MB
    q = ctx.Queue()
    port = free_rendezvous_port("127.0.0.1")  # below the ephemeral range: no outgoing connection takes it first
    with warnings.catch_warnings():  # torch names the *_into_tensor collectives deprecated in favour of *_single
        warnings.simplefilter("ignore", FutureWarning)
        procs = [ctx.Process(target=_collectives_rank, args=(r, port, threads, numel, q), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            t = q.get(timeout=180)  # spawned ranks import torch first
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    nbytes, lat = numel * 4, t["latency"]
    bus = lambda sec, moved: moved / max(sec - lat, 1e-9)  # noqa: E731
    return {"collective_latency_s": lat, "all_reduce_bw": bus(t["all_reduce"], nbytes),
            "all_gather_bw": bus(t["all_gather"], nbytes),
            "reduce_scatter_bw": bus(t["reduce_scatter"], nbytes / 2)}
