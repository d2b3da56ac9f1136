"""Host memory and step time of a GRPO run at a realistic model size, per layout, on this machine.

Runs the real recipe (``python -m recipes.main_ppo --config-name grpo``) on a model shaped like
Qwen2.5-0.5B: 494M parameters, hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864,
vocabulary 151,936, tied embeddings. The weights are seeded random, in fp32, with the demo's
character tokenizer. The run uses 2 prompts x 2 samples per step, 2 workers and 3 steps, and
saves a checkpoint at the end. Every row is computed in the update
(``skip_zero_advantage=false``): the random model scores all samples alike and would otherwise
skip them all.

While each run goes, a sampler reads memory twice a second:
- how far the host's ``MemAvailable`` fell below its value before the run (what the machine
  lost; shared memory counted once);
- the largest resident set of any one Ray worker process.

It prints JSON. Per layout it gives both peaks, the exit code (and why, if the run
failed) and the median ``timing_s/*`` of the steps after the first.

    .venv/bin/python scripts/bench/memory.py                       # fsdp, megatron_tp2, rollout_tp2
    .venv/bin/python scripts/bench/memory.py --layouts fsdp -- actor_rollout_ref.rollout.cpu_live_weights=true

Needs about 21 GB of free RAM for the default layouts; a run that exceeds the host is killed by
Ray's memory monitor and reported as such (rc 1), which is itself the figure to read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936, tied=True,
             max_positions=1024)
RUN = dict(workers=2, prompts=2, samples=2, steps=3)
BASE = [f"data.train_batch_size={RUN['prompts']}", f"actor_rollout_ref.rollout.n={RUN['samples']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={RUN['prompts']}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.cpu_live_weights=false", "actor_rollout_ref.rollout.kv_cache_gib=0.5",
        "data.max_response_length=8", f"trainer.total_training_steps={RUN['steps']}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.save_freq={RUN['steps']}",
        f"trainer.n_gpus_per_node={RUN['workers']}",
        "trainer.logger=[jsonl]",
        # a random model scores every sample alike, so by default every row would be skipped and
        # the update would be the optimizer step alone; compute them, activations and all
        "actor_rollout_ref.actor.skip_zero_advantage=false",
        # the figures in docs/benchmarks.md are fp32 (16 bytes of AdamW state per parameter);
        # param_dtype=auto would pick bf16 on a CPU with fast bf16 and add the bf16 compute copies
        "actor_rollout_ref.actor.param_dtype=fp32"]
LAYOUTS = {
    "fsdp": [],
    "megatron_tp2": ["actor_rollout_ref.actor.strategy=megatron",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
    "rollout_tp2": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
}
GB = 1e9


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class Sampler:
    """Peaks of host memory in use (MemAvailable drop) and of one Ray worker's RSS."""

    def __init__(self, interval_s: float = 0.5):
        import psutil

        self.psutil, self.interval_s = psutil, interval_s
        self.baseline = mem_available()
        self.peak_used = self.peak_worker_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_used = max(self.peak_used, self.baseline - mem_available())
            for proc in self.psutil.process_iter(["name", "memory_info"]):
                name = proc.info["name"] or ""
                if name.startswith("ray::") and proc.info["memory_info"] is not None:
                    self.peak_worker_rss = max(self.peak_worker_rss, proc.info["memory_info"].rss)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def build_assets(work_dir: str) -> dict[str, str]:
    sys.path.insert(0, REPO)
    from hybridflow.data import ArithmeticTaskConfig, write_arithmetic_parquet
    from hybridflow.tiny import make_tiny_checkpoint

    data_dir = os.path.join(work_dir, "data")
    if not os.path.exists(os.path.join(data_dir, "val.parquet")):
        write_arithmetic_parquet(data_dir, ArithmeticTaskConfig(train_size=64, val_size=8, seed=0))
    model = os.path.join(work_dir, "qwen2.5-0.5b-shaped")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_tiny_checkpoint(model, "qwen2", **SHAPE)
    return {"data": data_dir, "model": model}


def parameters_m(model_dir: str) -> float:
    """Millions of parameters in the checkpoint, read from the safetensors headers only."""
    import math

    from safetensors import safe_open

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return round(total / 1e6, 1)


def drop_checkpoints(run_dir: str) -> None:
    """The run saves a checkpoint (its time is measured) and the final HF model: ~8 GB per layout
    at this size. Only the metrics are read, so the weights go as soon as the run ends."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if name.startswith("global_step_") or name == "hf":
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def recipe_command(data_dir: str, model: str, run_dir: str, overrides: list[str]) -> tuple[list[str], dict]:
    """``python -m recipes.main_ppo --config-name grpo`` on ``data_dir``'s train/val files and
    ``model``, writing into ``run_dir``, and the environment to run it in (from the repo root)."""
    cmd = [sys.executable, "-m", "recipes.main_ppo", "--config-name", "grpo",
           f"data.train_files=[{data_dir}/train.parquet]", f"data.val_files=[{data_dir}/val.parquet]",
           f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}", *overrides]
    return cmd, dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def run_layout(args, paths: dict, layout: str) -> dict:
    run_dir = os.path.join(args.work_dir, "runs", layout)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd, env = recipe_command(paths["data"], paths["model"], run_dir, [*BASE, *LAYOUTS[layout], *args.overrides])
    start = time.perf_counter()
    with Sampler() as sampler:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        finally:
            drop_checkpoints(run_dir)
    result = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
              "peak_host_used_gb": round(sampler.peak_used / GB, 2),
              "peak_worker_rss_gb": round(sampler.peak_worker_rss / GB, 2)}
    if proc.returncode:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        # the recipe's own stop lines; Ray's log monitor may flush worker output after them
        ours = [ln for ln in lines if ln.startswith(("out of memory:", "the run stopped"))]
        result["why"] = ours or lines[-2:]
        return result
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][1:]  # the first step pays one-off costs
    keys = sorted({k for r in steps for k in r if k.startswith("timing_s/")})
    result["median_after_step_1"] = {k: round(statistics.median(r[k] for r in steps if k in r), 3) for k in keys}
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--work-dir", default="/tmp/hybridflow-bench-memory")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="extra recipe overrides (after --), applied to every layout")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    paths = build_assets(args.work_dir)
    result = {"model": {"shape": "Qwen2.5-0.5B", **SHAPE, "dtype": "fp32", "parameters_m": parameters_m(paths["model"])},
              "run": {**RUN, "overrides": BASE + args.overrides},
              "host_memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1),
              "layouts": {}}
    for layout in args.layouts:
        result["layouts"][layout] = run_layout(args, paths, layout)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
