"""Shared fixtures of the FSDP engine tests: a seeded RL batch laid out as docs/contracts.md says,
and plain single-process HF references the engine is compared against."""
from __future__ import annotations

import torch

from hybridflow.protocol import DataProto

PAD_ID = 0


def make_rl_batch(rows: int, prompt_len: int, resp_len: int, vocab: int, seed: int = 0) -> DataProto:
    """Left-padded prompts + right-padded responses of random lengths (one row uses all R)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((rows, prompt_len + resp_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        p = int(torch.randint(2, prompt_len + 1, (1,), generator=gen))
        r = resp_len if i == 0 else int(torch.randint(1, resp_len + 1, (1,), generator=gen))
        ids[i, prompt_len - p: prompt_len + r] = torch.randint(3, vocab, (p + r,), generator=gen)
        mask[i, prompt_len - p: prompt_len + r] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
        "prompts": ids[:, :prompt_len].clone(), "responses": ids[:, prompt_len:].clone(),
        "response_mask": mask[:, prompt_len:].clone(),
        "advantages": torch.randn(rows, resp_len, generator=gen),
        "returns": torch.randn(rows, resp_len, generator=gen),
    }
    return DataProto.from_dict(tensors)


def make_grouped_rl_batch(prompts: int, n: int, prompt_len: int, resp_len: int, vocab: int,
                          seed: int = 0) -> DataProto:
    """GRPO's layout: each prompt's n samples on consecutive rows with the same left-padded prompt."""
    data = make_rl_batch(prompts * n, prompt_len, resp_len, vocab, seed=seed)
    b = data.batch
    for key in ("input_ids", "attention_mask"):
        b[key][:, :prompt_len] = b[key][::n, :prompt_len].repeat_interleave(n, 0)
    b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    b["prompts"] = b["input_ids"][:, :prompt_len].clone()
    return data


def hf_response_log_probs(model, data: DataProto, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook reference: full padded forward, log_softmax of logits[P+t-1] / T, gather token t."""
    b = data.batch
    resp_len = b["responses"].shape[1]
    prompt_len = b["input_ids"].shape[1] - resp_len
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits.float()
    logp = torch.log_softmax(logits[:, prompt_len - 1: -1] / temperature, dim=-1)
    return logp.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1), b["response_mask"].bool()


def policy_gradient_loss(outputs, micro):
    """-A * log pi as an exact token mean over the whole mini-batch (see mini_batch_token_mean)."""
    from workers.engines.base import mini_batch_token_mean

    mask = micro.batch["response_mask"].float()
    loss = mini_batch_token_mean(-micro.batch["advantages"] * outputs["log_probs"], mask, micro)
    return loss, {"pg_loss": loss.item()}


def value_loss(outputs, micro):
    from workers.engines.base import mini_batch_token_mean

    mask = micro.batch["response_mask"].float()
    loss = mini_batch_token_mean((outputs["values"] - micro.batch["returns"]) ** 2, mask, micro)
    return loss, {"vf_loss": loss.item()}
