"""Sample a checkpoint on the counting task's prompts with vLLM, in a process of its own.

    python scripts/bench/workloads/count_sample.py MODEL PARQUET [--n 4] [--seed 0]

Prints one JSON line: per sample its response length in tokens, counted as the rollout counts
``response_length`` (up to and including the first EOS, at most ``--max-tokens``,
``workers/rollout/base.py: truncate_at_stop``) and its score (``hybridflow.rewards.count``), for
sampling at temperature 1 (the GRPO rollout's defaults: top_p 1, top_k off) with ``--n`` samples per
prompt, and greedily with one; plus the answers' own lengths (EOS included) for the same prompts.
With ``--pairs-out DIR`` it writes the temperature-1 samples as SFT pairs instead (the draft
model's distillation data, count_draft.py) and skips the greedy pass.

The engine is built as the rollout builds it on CPU (``workers/rollout/vllm_rollout.py``):
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), fp32 by default (``--dtype``; the checkpoint's
dtype, not vLLM's bf16 ``auto``), token ids in and out with no tokenizer in the engine (transformers 5 would build Qwen's
tokenizer class for the char tokenizer), EOS as a stop token id, and the sampler's two tiny
``torch.compile`` helpers run eagerly (their first compile costs up to a minute on a fresh
machine). A process of its own, so the builder's Ray (if any) and this engine never share one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VAL_PAIRS = 64  # --pairs-out: the last pairs, kept for the SFT recipe's validation


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("parquet")
    p.add_argument("--n", type=int, default=4, help="samples per prompt at temperature 1")
    p.add_argument("--limit", type=int, default=0, help="first LIMIT prompts only (0: all)")
    p.add_argument("--max-tokens", type=int, default=256, help="the workload's max_response_length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--first-row", type=int, default=0, help="skip the prompts before this row")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (bfloat16: as the rollout runs)")
    p.add_argument("--pairs-out", default=None,
                   help="write the temperature-1 samples as SFT pairs (sft_train/sft_val.parquet, the last "
                        "VAL_PAIRS for validation) under this folder, and skip the greedy pass")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    sys.path.insert(0, REPO)
    import pandas as pd
    import torch
    from vllm import LLM, SamplingParams

    from hybridflow.data.dataset import encode_prompt
    from hybridflow.rewards.count import compute_score
    from hybridflow.tiny import load_tokenizer
    from workers.rollout.base import truncate_at_stop

    rows = pd.read_parquet(args.parquet).iloc[args.first_row:]
    if args.limit:
        rows = rows.iloc[:args.limit]
    tokenizer = load_tokenizer(args.model)
    # as the GRPO runs feed it: data.apply_chat_template=false, the one user message as raw text
    prompts = [{"prompt_token_ids": encode_prompt(tokenizer, list(p), apply_chat_template=False)}
               for p in rows["prompt"]]
    truths = [r["ground_truth"] for r in rows["reward_model"]]
    eos = tokenizer.eos_token_id

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True, seed=args.seed,
              max_model_len=512, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    engine_s = time.perf_counter() - start

    def run(n: int, temperature: float) -> dict:
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=args.max_tokens,
                                stop_token_ids=[eos], detokenize=False)
        t0 = time.perf_counter()
        with torch.compiler.set_stance("force_eager"):
            outputs = llm.generate(prompts, params, use_tqdm=False)
        lengths, scores, texts = [], [], []
        for out, truth in zip(outputs, truths):
            for c in out.outputs:
                tokens, _ = truncate_at_stop(c.token_ids, [], [eos], args.max_tokens)
                lengths.append(len(tokens))
                texts.append(tokenizer.decode([t for t in tokens if t != eos]))
                scores.append(compute_score(texts[-1], truth))
        return {"lengths": lengths, "scores": scores, "seconds": round(time.perf_counter() - t0, 2), "texts": texts}

    sampled = run(args.n, 1.0)
    texts = sampled.pop("texts")
    if args.pairs_out:
        pairs = pd.DataFrame({"prompt": [list(p) for p in rows["prompt"] for _ in range(args.n)], "response": texts})
        os.makedirs(args.pairs_out, exist_ok=True)
        pairs.iloc[:-VAL_PAIRS].to_parquet(os.path.join(args.pairs_out, "sft_train.parquet"))
        pairs.iloc[-VAL_PAIRS:].to_parquet(os.path.join(args.pairs_out, "sft_val.parquet"))
        print(json.dumps({"pairs": len(pairs), "prompts": len(prompts), "engine_s": round(engine_s, 2)}))
        return 0
    greedy = run(1, 0.0)
    greedy.pop("texts")
    answer_lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in truths]
    print(json.dumps({"sampled": sampled, "greedy": greedy, "data_lengths": answer_lengths, "n": args.n,
                      "prompts": len(prompts), "engine_s": round(engine_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
