"""Benchmark the rollout layer: generated tokens/s of VLLMRollout vs bare vLLM vs HFRollout.

All three generate for the same left-padded prompts with the same sampling settings and stop ids.
"bare vLLM" calls ``LLM.generate`` on the rollout's own engine with token-id prompts, so the gap
to VLLMRollout is the cost of the rollout's bookkeeping (settings, padding, batch assembly).
Runs in one process under a 1-rank gloo world (the rollout's SPMD setting with tp_g=1).

    python scripts/bench/rollout.py --batch 64 --prompt-len 16 --response-len 64 --repeats 2

Prints JSON: per method, seconds and generated tokens/s (best of --repeats), plus ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from e2e import SIZES as E2E_SIZES  # noqa: E402  (this folder is sys.path[0] when run as a script)
from hybridflow.tiny import TINY_ARCHS  # noqa: E402


def prompts_batch(batch: int, prompt_len: int, vocab_lo: int, vocab_hi: int, pad: int, seed: int):
    from hybridflow.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g)
    ids = torch.full((batch, prompt_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, prompt_len - n:] = torch.randint(vocab_lo, vocab_hi, (n,), generator=g)
        mask[i, prompt_len - n:] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": torch.clamp(mask.cumsum(1) - 1, min=0)})


# Model shapes for make_tiny_checkpoint: its default, and e2e.py's "medium" (issue 6's ~25M model)
SIZES = {"tiny": {}, "medium": E2E_SIZES["medium"]}


def best_of(repeats: int, fn):
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, tokens)
    return {"seconds": round(best[0], 4), "tokens": best[1], "tokens_per_s": round(best[1] / best[0], 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2", choices=TINY_ARCHS)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES),
                    help="tiny: make_tiny_checkpoint's default; medium: issue 6's ~25M model (e2e.py)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="HF rollout is slow: fewer prompts")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = ap.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29611"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from vllm import SamplingParams

    from hybridflow.device import init_distributed
    from hybridflow.tiny import make_tiny_checkpoint
    from workers.rollout.base import RolloutConfig, prompt_token_lists
    from workers.rollout.hf_rollout import HFRollout
    from workers.rollout.vllm_rollout import VLLMRollout

    init_distributed()
    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="bench_rollout_"), arch=args.arch,
                                **SIZES[args.size])
    config = RolloutConfig(prompt_length=args.prompt_len, response_length=args.response_len,
                           temperature=args.temperature, kv_cache_gib=args.kv_cache_gib)
    rollout = VLLMRollout(config, path)
    prompts = prompts_batch(args.batch, args.prompt_len, 3, 100, rollout.pad_token_id, seed=0)

    def ours(batch):
        return lambda: int(rollout.generate_sequences(batch).batch["response_mask"].sum())

    def bare():
        params = SamplingParams(temperature=args.temperature, max_tokens=args.response_len,
                                stop_token_ids=rollout.eos_token_ids, logprobs=0, detokenize=False)
        token_prompts = [{"prompt_token_ids": t} for t in prompt_token_lists(prompts, args.prompt_len)]
        outs = rollout.llm.generate(token_prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    ours(prompts)()  # warm-up
    result = {"vllm_rollout": best_of(args.repeats, ours(prompts)),
              "vllm_bare": best_of(args.repeats, bare)}
    hf_prompts = prompts[: args.hf_batch]
    hf = HFRollout(__import__("transformers").AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32), config)
    result["hf_rollout"] = best_of(args.repeats, lambda: int(
        hf.generate_sequences(hf_prompts).batch["response_mask"].sum()))
    result["vllm_rollout_same_batch_as_hf"] = best_of(args.repeats, ours(hf_prompts))
    result["rollout_over_bare"] = round(result["vllm_rollout"]["tokens_per_s"]
                                        / result["vllm_bare"]["tokens_per_s"], 3)
    result["vllm_over_hf_same_batch"] = round(result["vllm_rollout_same_batch_as_hf"]["tokens_per_s"]
                                              / result["hf_rollout"]["tokens_per_s"], 2)
    result["settings"] = vars(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
