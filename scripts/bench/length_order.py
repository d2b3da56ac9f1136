"""Micro-batches in length order (``model.group_by_length``, workers/engines/length_order.py, on
by default) against batch order (the key off), on the long-tail workload's lengths; prints one JSON.

One FSDP engine per order in this process (a 1-rank gloo world, ``--threads`` threads: one worker's
share of the default 2-slot layout), on the long-tail workload's warm-started model, in the dtype
``param_dtype=auto`` picks on this CPU. The batch is one rank's share of a long-tail GRPO step:
``--prompts`` prompts x ``--samples`` samples, prompts up to 24 tokens, each answer as long as one
of the task's training answers drawn at random (their profile: p50 20, p95 about 110 tokens, the
longest about 180), capped at ``--answer-cap``. Each repetition times, for each setting in turn, a log-prob pass
(``--infer-micro`` rows per forward, the old log-prob and reference passes' default) and an update
(``--micro`` rows per forward/backward, the default); medians over ``--repeats``. Also printed:
the token positions each order's micro-batches feed the model (prompts shared), which is what the
time follows, whether the engine took length order (it does only where that feeds fewer), and the
largest difference between the two settings' log-probs.

    .venv/bin/python scripts/bench/length_order.py              # about 2 min with the assets cached
    .venv/bin/python scripts/bench/length_order.py --prompt-repeat 8 --answer-cap 24   # long prompts
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
sys.path.insert(0, REPO)


def long_tail_batch(model: str, data: str, prompts: int, samples: int, prompt_len: int, resp_len: int, seed: int,
                    prompt_repeat: int = 1):
    """``prompts x samples`` rows: the task's prompts (each ``prompt_repeat`` times over: a long
    prompt), left-padded; answers of the task's lengths capped at ``resp_len`` (random tokens: the
    time does not depend on them), right-padded; GRPO's row layout."""
    import pandas as pd
    import torch
    from transformers import AutoTokenizer

    from hybridflow.data.count import answer_tokens
    from hybridflow.protocol import DataProto

    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model)
    rows = pd.read_parquet(os.path.join(data, "train.parquet"))
    lengths = [min(answer_tokens(int(x["count"])) + 1, resp_len) for x in rows["extra_info"]]
    n = prompts * samples
    ids = torch.full((n, prompt_len + resp_len), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p in range(prompts):
        text = rows["prompt"][p][0]["content"]
        t = torch.tensor(tok(text, add_special_tokens=False)["input_ids"] * prompt_repeat)[-prompt_len:]
        for s in range(samples):
            i, r = p * samples + s, rng.choice(lengths)
            ids[i, prompt_len - len(t):prompt_len] = t
            ids[i, prompt_len:prompt_len + r] = torch.randint(3, len(tok), (r,))
            mask[i, prompt_len - len(t):prompt_len + r] = 1
    gen = torch.Generator().manual_seed(seed)
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt_len:].clone(), "response_mask": mask[:, prompt_len:].clone(),
        "advantages": torch.randn(n, resp_len, generator=gen)}), lengths


def pg_loss(outputs, micro):
    from workers.engines.base import mini_batch_token_mean

    mask = micro.batch["response_mask"].float()
    loss = mini_batch_token_mean(-micro.batch["advantages"] * outputs["log_probs"], mask, micro)
    return loss, {"pg_loss": loss.item()}


def measure(args) -> dict:
    import torch
    import torch.distributed as dist

    from workers.engines.config import EngineConfig
    from workers.engines.fsdp import FSDPEngine
    from workers.engines.length_order import in_length_order, length_order, padded_positions
    from workloads.count_model import build_longtail_assets, rollout_dtype

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29563"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    paths = build_longtail_assets(REPO)
    dtype = "bf16" if rollout_dtype() == "bfloat16" else "fp32"
    data, lengths = long_tail_batch(paths["model"], paths["data"], args.prompts, args.samples, 24 * args.prompt_repeat,
                                    args.answer_cap, args.seed, args.prompt_repeat)
    data.meta_info["temperature"] = 1.0
    engines = {grouped: FSDPEngine(EngineConfig(param_dtype=dtype, lr=1e-5, micro_batch_size_per_gpu=args.micro,
                                                infer_micro_batch_size_per_gpu=args.infer_micro,
                                                group_by_length=grouped, seed=0), paths["model"], "actor")
               for grouped in (False, True)}
    times = {g: {"log_prob": [], "update": []} for g in engines}
    log_probs, first = {}, {}
    for _ in range(args.repeats + 1):  # the first round warms both up
        for grouped, engine in engines.items():
            start = time.perf_counter()
            log_probs[grouped], _ = engine.compute_log_prob(data, 1.0)
            first.setdefault(grouped, log_probs[grouped])
            middle = time.perf_counter()
            engine.train_batch(data, pg_loss)
            times[grouped]["log_prob"].append(middle - start)
            times[grouped]["update"].append(time.perf_counter() - middle)
    mask = data.batch["response_mask"].bool()
    med = {g: {k: round(statistics.median(v[1:]), 3) for k, v in t.items()} for g, t in times.items()}
    order = length_order(data)

    def positions(rows: int) -> dict:
        # as the engine feeds them (prompts shared); "taken": the engine's choice with the key on
        return {"batch_order": padded_positions(data, None, rows, None, True),
                "length_order": padded_positions(data, order, rows, None, True),
                "length_order_taken": in_length_order(data, True, rows, None, True)[1] is not None}
    return {
        "setting": dict(dtype=dtype, threads=args.threads, rows=len(data), prompts=args.prompts, samples=args.samples,
                        prompt_tokens=24 * args.prompt_repeat, answer_cap=args.answer_cap,
                        micro=args.micro, infer_micro=args.infer_micro, repeats=args.repeats,
                        answer_tokens_mean=round(sum(lengths) / len(lengths), 1)),
        "batch_order_s": med[False], "key_on_s": med[True],
        "ratio_update": round(med[True]["update"] / med[False]["update"], 3),
        "ratio_log_prob": round(med[True]["log_prob"] / med[False]["log_prob"], 3),
        "padded_positions": {"update": positions(args.micro), "log_prob": positions(args.infer_micro)},
        # the first pass runs on the checkpoint's weights; the last after the same updates in both orders
        "log_prob_max_abs_diff_first_pass": float((first[True] - first[False])[mask].abs().max()),
        "log_prob_max_abs_diff_last_pass": float((log_probs[True] - log_probs[False])[mask].abs().max()),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts in the rank's share (GRPO groups)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--micro", type=int, default=4, help="rows per forward/backward of the update")
    p.add_argument("--infer-micro", type=int, default=8, help="rows per forward of the log-prob pass")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-repeat", type=int, default=1,
                   help="each prompt this many times over (24 tokens each): long prompts, where the order loses")
    p.add_argument("--answer-cap", type=int, default=256, help="answers cut to this many tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    result = measure(p.parse_args(argv))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
