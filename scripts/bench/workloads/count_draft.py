"""A draft model for speculative rollout on the long-tail counting workload
(``rollout.speculative.method=draft_model``), distilled from the workload's policy and cached.

    .venv/bin/python scripts/bench/workloads/count_draft.py [--rebuild]

``build_draft_model()`` (import with scripts/bench on sys.path) returns ``DRAFT_MODEL``, built when
missing:

1. the policy (``qwen2-medium-count-sft``, 25M parameters) samples ``SAMPLES`` answers to each
   training prompt from ``FIRST_ROW`` on, at temperature 1 and up to 256 tokens, as the rollout
   samples (vLLM, bf16, in a process of its own): the draft learns what the policy writes, long
   tails included, not only the task's answers (sequence-level distillation, the usual way to
   make a draft agree with its target). The speculative bench reads rows below ``FIRST_ROW``, so
   the draft has not seen its prompts;
2. the e2e bench's demo shape (hidden 128, 2 layers: 0.3M parameters, ``DRAFT_SHAPE``), seeded, same char
   tokenizer, learns those pairs through the SFT recipe (``DRAFT_SFT_STEPS`` steps).

Like a draft model in training, it is frozen: the policy it was distilled from is the one the
bench samples, while in RL the policy moves on from it.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

from workloads.count_model import DATA, build_inputs, build_longtail_assets, run_sft, sft_overrides  # noqa: E402

DRAFT_DATA = "data/count-distill"
DRAFT_INIT = "data/models/qwen2-demo-count-init"
DRAFT_MODEL = "data/models/qwen2-demo-count-draft"
DRAFT_RUN = "runs/count-draft"
FIRST_ROW = 256  # the speculative bench reads the first (batches + 1) x 16 rows
SAMPLES = 2
DRAFT_SFT_STEPS = 600
# the e2e bench's demo shape. Tried as well (2026-11-27): hidden 256 on 4 samples a prompt and 1200
# steps, a lower validation NLL yet 0.48 of its drafts accepted (this one: 0.60) and slower passes
DRAFT_SHAPE = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, tied=True)

_SAMPLE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
import pandas as pd, torch
from vllm import LLM, SamplingParams
from hybridflow.data.dataset import encode_prompt
from hybridflow.tiny import load_tokenizer
from workers.rollout.base import truncate_at_stop
model, parquet, out, first, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rows = pd.read_parquet(parquet).iloc[first:]
tok = load_tokenizer(model)
prompts = [{"prompt_token_ids": encode_prompt(tok, list(p), apply_chat_template=False)} for p in rows["prompt"]]
llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0, max_model_len=512,
          kv_cache_memory_bytes=2**30)
params = SamplingParams(n=n, temperature=1.0, max_tokens=256, stop_token_ids=[tok.eos_token_id], detokenize=False)
with torch.compiler.set_stance("force_eager"):
    outputs = llm.generate(prompts, params, use_tqdm=False)
pairs = []
for prompt, o in zip(rows["prompt"], outputs):
    for c in o.outputs:
        ids, _ = truncate_at_stop(list(c.token_ids), [], [tok.eos_token_id], 256)
        pairs.append({"prompt": list(prompt), "response": tok.decode([t for t in ids if t != tok.eos_token_id])})
os.makedirs(out, exist_ok=True)
frame = pd.DataFrame(pairs)
frame.iloc[: len(frame) - 64].to_parquet(os.path.join(out, "sft_train.parquet"))
frame.iloc[len(frame) - 64:].to_parquet(os.path.join(out, "sft_val.parquet"))
print(json.dumps({"pairs": len(pairs)}))
"""


def _distill_pairs(root: str, policy: str) -> None:
    """The policy's sampled answers as SFT pairs under ``DRAFT_DATA`` (a process of its own)."""
    parquet = os.path.join(root, DATA, "train.parquet")
    out = os.path.join(root, DRAFT_DATA)
    cmd = [sys.executable, "-c", _SAMPLE, policy, parquet, out, str(FIRST_ROW), str(SAMPLES)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"count_draft: sampling the policy failed ({done.returncode}):\n{done.stderr[-3000:]}")


def build_draft_model(root: str = REPO, rebuild: bool = False) -> str:
    """The draft's folder, built when missing (module docstring); concurrent callers wait on a lock."""
    root = os.path.abspath(root)
    sys.path.insert(0, REPO)
    model, init = os.path.join(root, DRAFT_MODEL), os.path.join(root, DRAFT_INIT)
    os.makedirs(os.path.dirname(model), exist_ok=True)
    with open(model + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(model, "config.json")) and not rebuild:
            return model
        policy = build_longtail_assets(root)["model"]
        build_inputs(root)
        if not os.path.exists(os.path.join(init, "config.json")):
            from hybridflow.tiny import make_tiny_checkpoint

            make_tiny_checkpoint(init, "qwen2", seed=1, **DRAFT_SHAPE)
        _distill_pairs(root, policy)
        partial = DRAFT_MODEL + ".partial"
        for stale in (partial, DRAFT_RUN):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        # the demo shape trains fastest in fp32 in one process; a higher LR for the small model
        overrides = [o for o in sft_overrides(root, DRAFT_INIT, partial, DRAFT_RUN, DRAFT_DATA)
                     if not o.startswith(("trainer.n_gpus_per_node", "model.param_dtype", "optim.lr"))]
        run_sft(root, DRAFT_SFT_STEPS, overrides + ["trainer.n_gpus_per_node=1", "optim.lr=3e-3"])
        shutil.rmtree(model, ignore_errors=True)
        os.rename(os.path.join(root, partial), model)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rebuild", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps({"draft_model": build_draft_model(rebuild=args.rebuild)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
