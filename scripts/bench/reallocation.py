"""Sample reallocation (issue 35 item 4, RLHFSpec): the batch's generation time when one rollout rank
is dealt three times the long samples of the other, with and without reallocation, one invocation.

Workload: the long-tail counting model and prompts (workloads/count_model.py, docs/benchmarks.md
"Long-tail workload"), greedy, one sample per prompt, answers up to 256 tokens, on the hybrid
worker group our recipe builds (GRPO config, ``--workers`` CPU slots: generation DP = 2, TP = 1).
A warm-up ``generate_sequences`` over ``--candidates`` training prompts measures each one's greedy
answer length; "long" are those at or above the candidates' ``--long-quantile`` length, "short" the
rest. The batch: ``--per-rank`` prompts per rank, rank 0 dealt ``--long-ratio`` times the long ones
of rank 1 (rank 0: 3k long + the rest short, rank 1: k long + the rest short, k = per_rank / 4 by
default, so both ranks hold the same number of samples: only their lengths differ), in the
contiguous split the group's dispatch makes. Each engine runs at most ``--max-num-seqs`` (32) of
its rank's 64 samples at once and queues the rest, as RL rollouts do (a rank's share of a GRPO
batch is hundreds to thousands of samples against vLLM's 256); ``--max-num-seqs 256`` runs every
sample from the first step, where the even deal bounds any reallocation at about 0.81 on 2 CPU
cores (docs/benchmarks.md).

Each repetition times, in turn (the order reversed every other repetition): ``plain``
(``generate_sequences``: what the trainer does without reallocation), ``even``
(``generate_sequences`` of the same prompts dealt evenly, every other long and short one to each
rank: a deal balanced from the start, the mark reallocation aims at, with no move and no stream),
``stream`` (``GenerationStream`` without rebalancing: the stream's own cost), ``reallocated``
(``GenerationStream(rebalance=--threshold)``, queued samples moved, or running ones too with
``--move-started``, started on the receiver before its own waiting samples unless
``--adopted-last``: what the trainer does with ``rollout.reallocation.enable`` in its first epoch)
and ``dealt`` (the prompts dealt by their warm-up answers' lengths: what it does from the second
epoch on, ``deal_by_length``; every length known, so no sample moves: ``rebalance_threshold``).
Prints one JSON: the times and their medians, the ratios reallocated / plain (the issue's goal: <=
0.7), of the medians and paired (each repetition's own, then their median), dealt / plain,
reallocated / stream and even / plain, the share of the even deal's gain reallocation got, each
rank's finish time in the streams, the samples moved, whether the tokens are generate_sequences'
(greedy) and the largest log-prob difference, and the engine's seconds per step by the sequences it
runs (``step_s_by_running_per_rank``) with the best ratio that curve allows (``ideal_ratio``: the
busier rank alone against the running sequences shared evenly at every step, moves free; only where
nothing queues).

    .venv/bin/python scripts/bench/reallocation.py               # about 17 min with assets cached
    .venv/bin/python scripts/bench/reallocation.py --max-num-seqs 256 --move-started --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# timed in this order in even repetitions, in the reverse order in odd ones
MODES = ("plain", "even", "stream", "reallocated", "dealt")
BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, REPO)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF checkpoint (default: the workload's warm-started model)")
    p.add_argument("--data", default=None, help="a folder with train.parquet (default: the workload's)")
    p.add_argument("--workers", type=int, default=2, help="CPU slots = generation data-parallel ranks")
    p.add_argument("--candidates", type=int, default=512, help="training prompts measured to pick long and short")
    p.add_argument("--long-quantile", type=float, default=0.75, help="long: greedy length at or above this quantile")
    p.add_argument("--per-rank", type=int, default=64, help="prompts per generation rank")
    p.add_argument("--long-ratio", type=int, default=3, help="rank 0's long prompts over rank 1's")
    p.add_argument("--long-per-rank1", type=int, default=None, help="rank 1's long prompts (default per_rank / 4)")
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32, help="rollout.max_num_seqs: sequences an engine runs at once")
    p.add_argument("--move-started", action="store_true", help="rollout.reallocation.move_started=true")
    p.add_argument("--adopted-last", action="store_true",
                   help="rollout.reallocation.adopted_first=false: moved samples wait behind the receiver's own")
    p.add_argument("--threshold", type=float, default=0.25, help="rollout.reallocation.threshold")
    p.add_argument("--slice-s", type=float, default=0.1, help="rollout.reallocation.slice_s")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--step-cost", default="1,8,16,32,48,64,96,128",
                   help="running sequences per rank to time engine steps at ('' skips)")
    p.add_argument("overrides", nargs="*", help="extra recipe key=value overrides (after --)")
    return p.parse_args(argv)


def _config(args, paths: dict):
    from recipes.main_ppo import load_and_validate

    work = os.path.join(REPO, "runs", "bench-reallocation")
    return load_and_validate([
        "--config-name", "grpo", "algorithm.adv_estimator=reinforce_plus_plus", f"data.train_files=[{paths['data']}/train.parquet]",
        f"data.val_files=[{paths['data']}/val.parquet]", f"actor_rollout_ref.model.path={paths['model']}",
        "data.apply_chat_template=false", "data.max_prompt_length=24", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.candidates}", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.do_sample=false", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.candidates}",
        "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.n_gpus_per_node={args.workers}",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"actor_rollout_ref.rollout.max_num_seqs={args.max_num_seqs}",
        # the settings the streams run with, and the engines as the trainer builds them for them
        # (adopted_first: vLLM's priority policy)
        "actor_rollout_ref.rollout.reallocation.enable=true",
        f"actor_rollout_ref.rollout.reallocation.threshold={args.threshold}",
        f"actor_rollout_ref.rollout.reallocation.slice_s={args.slice_s}",
        f"actor_rollout_ref.rollout.reallocation.move_started={args.move_started}",
        f"actor_rollout_ref.rollout.reallocation.adopted_first={not args.adopted_last}",
        f"trainer.default_local_dir={work}", *args.overrides])


def _groups(cfg):
    """The recipe's worker groups (recipes/main_ppo.py ``_run``), the actor's initialised."""
    import ray

    from hybridflow.trainer.placement import build_worker_groups
    from recipes.build import role_specs
    from recipes.main_ppo import read_inputs
    from recipes.worker_env import worker_env

    inputs = read_inputs(cfg)
    if ray.is_initialized():  # a caller's Ray (measure() imported by another bench) would not carry our env
        raise RuntimeError("reallocation.measure starts its own Ray instance: call it with Ray not initialised")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(cfg, cfg.actor_rollout_ref.model.path), "PYTHONPATH": REPO}})
    main_roles, side_roles = role_specs(cfg, inputs.derived)
    groups, pools = build_worker_groups(cfg, main_roles, side_roles, use_gpu=False)
    groups["actor_rollout_ref"].init_model()
    return inputs, groups, pools


def _deal(args, lengths, candidates):
    """Prompt indices in the order dealt: rank 0's share, then rank 1's (3k long on rank 0, k on rank 1)."""
    import torch

    threshold = float(torch.quantile(lengths.float(), args.long_quantile))
    long_ = [i for i in range(len(candidates)) if lengths[i] >= threshold]
    short = [i for i in range(len(candidates)) if lengths[i] < threshold]
    k = args.long_per_rank1 if args.long_per_rank1 is not None else args.per_rank // 4
    need_long, need_short = (args.long_ratio + 1) * k, 2 * args.per_rank - (args.long_ratio + 1) * k
    if args.long_ratio * k > args.per_rank or len(long_) < need_long or len(short) < need_short:
        raise SystemExit(f"not enough prompts: {len(long_)} long (>= {threshold:g} tokens) and {len(short)} short "
                         f"for {need_long} and {need_short}; raise --candidates or lower --per-rank")
    rank0 = long_[:args.long_ratio * k] + short[:args.per_rank - args.long_ratio * k]
    rank1 = long_[args.long_ratio * k:need_long] + short[args.per_rank - args.long_ratio * k:need_short]
    # the same prompts dealt evenly (every other one of each kind): no reallocation can beat it
    longs, shorts = long_[:need_long], short[:need_short]
    even = longs[0::2] + shorts[0::2] + longs[1::2] + shorts[1::2]
    return rank0 + rank1, even, threshold, k


def _stream(actor, batch, realloc, rebalance, lengths=None):
    """``realloc``: the config's ``rollout.reallocation`` section; ``rebalance``: None or its threshold."""
    from hybridflow.controller.stream import ROW_INDEX, GenerationStream

    stream = GenerationStream(actor, batch, n=1, slice_s=realloc.slice_s, rebalance=rebalance, lengths=lengths,
                              move_started=realloc.move_started, adopted_first=realloc.adopted_first)
    for _ in stream:
        pass
    out = stream.batch()
    out.pop([ROW_INDEX])
    finished = [(r.closed_at or 0) - stream.started for r in stream.replicas]
    return out, stream, finished


def _step_cost(actor, candidates, sizes, workers) -> dict:
    """Seconds per engine step at b sequences per rank: 2 x b prompts, every answer run to 129
    tokens (ignore_eos), minus a 1-token call's time (prefill and call overhead), over 128: the
    mean over contexts of 24 to 153 tokens (a 256-token answer's mean context is about 150).
    Also the 1-token call's seconds: the prefill of b prompts per rank plus the call's overhead,
    what a move's KV recompute (prompt + prefix, one prefill) is of the same order as."""
    out, prefill = {}, {}
    for b in sizes:
        batch = candidates[0:b * workers]
        times = {}
        for tokens in (1, 129):
            req = batch.select()
            req.meta_info.update(n=1, do_sample=False, ignore_eos=True, max_tokens=tokens)
            t0 = time.perf_counter()
            actor.generate_sequences(req)
            times[tokens] = time.perf_counter() - t0
        out[b] = round((times[129] - times[1]) / 128, 5)
        prefill[b] = round(times[1], 4)
    return out, prefill


def measure(argv) -> dict:
    """Run the bench (``argv``: this script's arguments); returns the report as a dict."""
    import ray
    import torch

    from hybridflow.protocol import DataProto
    from hybridflow.trainer.async_rollout import generation_request
    from hybridflow.trainer.reallocated_rollout import rebalance_threshold
    from workloads.count_model import build_longtail_assets

    args = parse_args(argv)
    start, load = time.perf_counter(), os.getloadavg()[0]
    built = build_longtail_assets(REPO)
    paths = {"model": os.path.abspath(args.model or built["model"]), "data": os.path.abspath(args.data or built["data"])}
    cfg = _config(args, paths)
    realloc = cfg.actor_rollout_ref.rollout.reallocation
    inputs, groups, pools = _groups(cfg)
    actor = groups["actor_rollout_ref"]
    try:
        candidates = generation_request(DataProto.from_single_dict(inputs.train_loader.next_batch()), n=1)
        warm = actor.generate_sequences(candidates)  # also the engines' warm-up
        lengths = warm.batch["response_mask"].sum(1)
        order, even_order, long_min, k = _deal(args, lengths, candidates)
        batch, even = candidates[torch.tensor(order)], candidates[torch.tensor(even_order)]
        dealt = lengths[torch.tensor(order)]
        half = args.per_rank
        runs = {name: [] for name in MODES}
        moved, moves, same, lp_diff = [], [], True, 0.0
        # what the trainer deals by from the second epoch on: these prompts' answers at the warm-up
        known = [float(x) for x in dealt]
        want = actor.generate_sequences(batch)  # the tokens every mode must give (greedy)
        streams = {"stream": (None, None), "reallocated": (realloc.threshold, None),
                   "dealt": (rebalance_threshold(realloc, known), known)}
        rank_finish = {name: [] for name in streams}
        for rep in range(args.reps):
            # this machine's speed drifts by 10-25% within a minute (docs/benchmarks.md), so the
            # modes' order is reversed every other repetition, as speculative.py does
            for name in MODES if rep % 2 == 0 else reversed(MODES):
                t0 = time.perf_counter()
                if name in ("plain", "even"):
                    actor.generate_sequences(batch if name == "plain" else even)
                    runs[name].append(time.perf_counter() - t0)
                    continue
                rebalance, lengths = streams[name]
                got, stream, finished = _stream(actor, batch, realloc, rebalance, lengths)
                runs[name].append(time.perf_counter() - t0)
                rank_finish[name].append([round(f, 3) for f in finished])
                same &= all(torch.equal(got.batch[key], want.batch[key]) for key in ("responses", "response_mask"))
                lp_diff = max(lp_diff, float((got.batch["rollout_log_probs"] - want.batch["rollout_log_probs"]).abs().max()))
                if name == "reallocated":
                    moved.append(stream.reallocated)
                    moves.append(stream.reallocations)
        # the curve is of sequences running together: none above what an engine runs at once
        sizes = [int(s) for s in args.step_cost.split(",") if s and int(s) <= args.max_num_seqs]
        step_cost, prefill = _step_cost(actor, candidates, sizes, args.workers) if sizes else ({}, {})
    finally:
        for group in {id(g._actors[0]): g for g in groups.values()}.values():
            group.shutdown()
        for pool in pools:
            pool.release()
        ray.shutdown()
    med = {name: round(statistics.median(times), 3) for name, times in runs.items()}
    report = {
        "setting": {"model": paths["model"], "data": paths["data"], "workers": args.workers, "per_rank": half,
                    "long_per_rank": [args.long_ratio * k, k], "long_min_tokens": long_min,
                    "response_length": args.response_length, "max_num_seqs": args.max_num_seqs,
                    "move_started": realloc.move_started, "adopted_first": realloc.adopted_first,
                    "threshold": realloc.threshold, "slice_s": realloc.slice_s,
                    "reps": args.reps, "greedy": True, "overrides": args.overrides, "cpus": os.cpu_count(),
                    "cpu": _cpu(), "rollout_dtype": cfg.actor_rollout_ref.rollout.dtype,
                    "load_avg_1m_at_start": load},
        "dealt_tokens_per_rank": [int(dealt[:half].sum()), int(dealt[half:].sum())],
        "dealt_lengths_p50_max_per_rank": [[int(dealt[:half].median()), int(dealt[:half].max())],
                                           [int(dealt[half:].median()), int(dealt[half:].max())]],
        "seconds": {name: [round(t, 3) for t in times] for name, times in runs.items()},
        "median_s": med,
        "ratio_reallocated_over_plain": round(med["reallocated"] / med["plain"], 3),
        # each repetition's ratio (its two runs a few seconds apart), then their median: less
        # moved by the machine's drift than the ratio of medians
        "ratio_reallocated_over_plain_paired": _paired(runs, "reallocated"),
        "ratio_reallocated_over_stream": round(med["reallocated"] / med["stream"], 3),
        # dealt by the answers' earlier lengths, no move (the trainer's default from epoch 2)
        "ratio_dealt_over_plain": round(med["dealt"] / med["plain"], 3),
        "ratio_dealt_over_plain_paired": _paired(runs, "dealt"),
        # the best any reallocation could do: the same prompts dealt evenly from the start
        "ratio_even_over_plain": round(med["even"] / med["plain"], 3),
        "share_of_even_gain": (round((med["plain"] - med["reallocated"]) / (med["plain"] - med["even"]), 3)
                               if med["plain"] > med["even"] else None),
        "rank_finish_s": rank_finish,
        "reallocated_samples": moved, "reallocations": moves,
        "tokens_identical": bool(same), "log_prob_max_abs_diff": lp_diff,
    }
    if step_cost:
        report["step_s_by_running_per_rank"] = step_cost
        report["one_token_call_s_by_prompts_per_rank"] = prefill
        if args.max_num_seqs >= half:  # the model has every sample running from the first step
            report["ideal_ratio"] = _ideal(dealt, half, step_cost)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def _paired(runs: dict, name: str) -> dict:
    """``name`` over plain within each repetition, and the median of those ratios."""
    ratios = [round(t / p, 3) for t, p in zip(runs[name], runs["plain"])]
    return {"median": round(statistics.median(ratios), 3), "by_repetition": ratios}


def _cpu() -> str:
    """The CPU's model and the flags a speed figure depends on (docs: the CPU is not always the same)."""
    from _equal_work import cpu_in_hand

    cpu = cpu_in_hand()
    return f"{cpu['model']} [{' '.join(cpu['flags'])}]"


def _ideal(dealt, half: int, step_cost: dict) -> float:
    """Reallocation's best case from the step-cost curve: each rank's decode as sum over steps of
    step_s(running), rank 0 alone (unbalanced) against both ranks sharing the batch's running
    sequences evenly at every step (perfect, free moves); the ratio of the slower rank's sums."""
    import numpy as np

    sizes = sorted(step_cost)
    cost = lambda running: float(np.interp(running, sizes, [step_cost[s] for s in sizes])) if running else 0.0  # noqa: E731
    lengths = [dealt[:half].tolist(), dealt[half:].tolist()]
    steps = int(max(max(x) for x in lengths))
    alone = max(sum(cost(sum(1 for n in rank if n > s)) for s in range(steps)) for rank in lengths)
    shared = sum(cost(sum(1 for rank in lengths for n in rank if n > s) / 2) for s in range(steps))
    return round(shared / alone, 3)


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1:]), indent=2))
