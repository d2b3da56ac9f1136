"""The reward-model worker: an HF sequence-classification model scoring whole sequences.

The score of a sequence is the classifier's output at its last real token (the attention mask's,
see :func:`last_token_scores`), placed on the last response token (as rule rewards are). The reward model must share the actor's tokenizer (the
common case for RLHF pipelines built from one base model); a different tokenizer is refused at
load time rather than silently scoring the wrong ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow import device
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.model_overrides import import_external_lib
from hybridflow.protocol import DataProto
from hybridflow.trajectory import last_generated_index


@dataclass
class RewardModelSettings:
    model_path: str
    micro_batch_size_per_gpu: int = 8
    actor_vocab_size: int | None = None
    external_lib: str | None = None  # imported before the model is built (as the actor worker's)


class RewardModelWorker(Worker):
    def __init__(self, settings: RewardModelSettings):
        super().__init__()
        self.s = settings
        self.model = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from transformers import AutoModelForSequenceClassification

        self.init_distributed()
        import_external_lib(self.s.external_lib)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.s.model_path, torch_dtype=torch.float32)
        if getattr(self.model, "score", None) is not None and self.model.config.pad_token_id is None:
            # transformers refuses batches without a pad id; last_token_scores does not read it
            self.model.config.pad_token_id = 0
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model.model.path={self.s.model_path}: a reward model needs num_labels=1, "
                             f"got {self.model.config.num_labels}")
        if self.s.actor_vocab_size and self.model.config.vocab_size != self.s.actor_vocab_size:
            raise ValueError(f"reward_model.model.path={self.s.model_path}: vocab {self.model.config.vocab_size} "
                             f"differs from the actor's {self.s.actor_vocab_size}; use a reward model built on the "
                             "actor's tokenizer")
        self.model.to(device.torch_device()).eval()
        self.register_mesh("reward_model", self.rank, self.world_size, True)
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        scores = []
        for micro in data.split(self.s.micro_batch_size_per_gpu):
            b = {k: micro.batch[k].to(self.model.device) for k in ("input_ids", "attention_mask", "position_ids")}
            scores.append(last_token_scores(self.model, **b).float().cpu())
        score = torch.cat(scores)
        mask = data.batch["response_mask"]
        token_scores = torch.zeros_like(mask, dtype=torch.float32)
        last = last_generated_index(mask)  # a multi-turn response has holes (tool tokens)
        token_scores[torch.arange(len(score)), last] = score
        return DataProto.from_dict({"rm_scores": token_scores})


def last_token_scores(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """``[B]``: the classifier's output at each row's last attended token.

    transformers' sequence classifiers pool at the last token that is not ``pad_token_id``. Where
    the pad token is EOS (SmolLM, many Llama-based reward models) that is the token before the EOS
    a finished response ends with, so the score would be read one token early. The head's output
    for every token is caught on its way out (a hook on ``score``, the head of transformers' causal
    LM classifiers) and read where the attention mask ends, as verl does. A model without a
    ``score`` head keeps transformers' pooling.
    """
    head = getattr(model, "score", None)
    if head is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0]
    caught = []
    handle = head.register_forward_hook(lambda module, args, out: caught.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        handle.remove()
    per_token = caught[-1][..., 0]  # [B, T]
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (columns * attention_mask.bool()).argmax(-1)
    return per_token[torch.arange(len(last), device=last.device), last]
