"""Shared fixtures for the rollout tests: tiny checkpoints, left-padded prompts, HF references."""
from __future__ import annotations

import torch

from hybridflow.protocol import DataProto
from hybridflow.tiny import load_tokenizer, make_tiny_checkpoint

PROMPT_LEN, RESPONSE_LEN = 12, 10
PROMPTS = ["12+3=", "hello world", "a", "What is 7*8?"]
MODELS = {"qwen2-tied": dict(arch="qwen2", tied=True), "llama-untied": dict(arch="llama", tied=False)}


def make_checkpoints(root, name: str) -> tuple[str, str]:
    """(initial, updated) checkpoints of one tiny model: same shapes, different seeded weights."""
    kw = MODELS[name]
    old = make_tiny_checkpoint(str(root / f"{name}-0"), seed=0, **kw)
    new = make_tiny_checkpoint(str(root / f"{name}-1"), seed=1, **kw)
    return old, new


def make_eos_first_checkpoint(path: str, out_dir: str, greedy: DataProto, eos: int) -> tuple[str, int]:
    """A copy of checkpoint ``path`` whose greedy response to one prompt starts with EOS, so
    ``ignore_eos`` has an EOS to run past: that prompt's first greedy token and EOS trade rows of
    the output layer (tied: of the embedding too, so the prompt must hold neither token; its hidden
    states are then unchanged). ``greedy`` is the checkpoint's greedy rollout of the prompts.
    Returns (the copy's path, the prompt's index)."""
    model = load_hf(path)
    b = greedy.batch
    for row in range(len(greedy)):
        first, prompt = int(b["responses"][row, 0]), b["prompts"][row][b["attention_mask"][row, :PROMPT_LEN].bool()]
        if first != eos and first not in prompt.tolist():
            break
    else:
        raise AssertionError("no prompt's first greedy token can trade places with EOS")
    with torch.no_grad():
        head = model.get_output_embeddings().weight  # the embedding itself when tied
        head[[first, eos]] = head[[eos, first]]
    model.save_pretrained(out_dir)
    return out_dir, row


def make_prompts(path: str, texts=PROMPTS, prompt_len: int = PROMPT_LEN, meta=None) -> DataProto:
    """Left-padded prompts as the data layer produces them, with a non-tensor uid column."""
    tok = load_tokenizer(path)
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = torch.full((len(rows), prompt_len), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, prompt_len - len(r):] = torch.tensor(r)
        mask[i, prompt_len - len(r):] = 1
    pos = torch.clamp(mask.cumsum(1) - 1, min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               {"uid": [f"p{i}" for i in range(len(rows))]}, meta or {})


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_log_probs(model, out: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """Contract formula: log_softmax(logits[P+t-1] / T)[response token t], by a full HF forward."""
    b = out.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits
    p = b["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1:-1].float() / temperature, dim=-1)
    return lp.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1) * b["response_mask"]


def assert_layout(out: DataProto, prompts: DataProto, n: int, stop_ids, pad_id: int) -> None:
    """Invariants every rollout batch must satisfy (docs/contracts.md batch-key table)."""
    b = out.batch
    rows, r = b["responses"].shape
    assert rows == len(prompts) * n
    assert b["input_ids"].shape == (rows, PROMPT_LEN + r)
    assert torch.equal(b["prompts"], prompts.batch["input_ids"].repeat_interleave(n, 0))
    assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(n)]
    mask = b["response_mask"]
    lengths = mask.sum(1)
    for i in range(rows):
        k = int(lengths[i])
        assert k >= 1 and mask[i, :k].all() and not mask[i, k:].any()  # a prefix of ones
        toks = b["responses"][i].tolist()
        assert all(t == pad_id for t in toks[k:])
        assert not any(t in stop_ids for t in toks[:k - 1])  # no stop token before the end
        assert k == r or toks[k - 1] in stop_ids  # ends at a stop token or at max_tokens
        assert not b["rollout_log_probs"][i, k:].any()
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    am = torch.cat([prompts.batch["attention_mask"].repeat_interleave(n, 0), mask], 1)
    assert torch.equal(b["attention_mask"], am)
    assert torch.equal(b["position_ids"], torch.clamp(am.cumsum(1) - 1, min=0))
    assert (b["rollout_log_probs"] <= 0).all()
