"""Rollout with transformers' ``generate`` on a given module: the fallback and the reference.

In production the module is the actor's own training module (no second copy of the weights, so
``update_weights`` has nothing to do); in tests it is a model loaded from the checkpoint. Output
layout is the same as the vLLM rollout's (``build_rollout_batch``).

Log-probs come from generate's ``scores``: the logits after the temperature / top-k / top-p
warpers, so ``log_softmax(scores)`` is the distribution the token was sampled from, the same
quantity vLLM reports in ``processed_logprobs`` mode. A fresh ``GenerationConfig`` is built per
call so the checkpoint's generation defaults (transformers' top_k=50, repetition penalties, ...)
never leak into RL sampling.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from workers.rollout.base import (RolloutConfig, build_rollout_batch, prompt_token_lists,
                                  resolve_sampling, special_token_ids, truncate_at_stop)


def _reshard(module: torch.nn.Module) -> None:
    """Put an FSDP2 module's parameters back in their shards after generating.

    FSDP2 never reshards the root after a forward (it expects the backward next), and generate
    goes around the engine, so the root's parameters (embeddings, final norm, head) would stay
    gathered as plain tensors. A training step that then computes nothing (every row skipped)
    would step the shards while the module kept computing with the stale gathered copy."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class HFRollout:
    """The Rollout protocol on ``module.generate``; every rank is its own generation-DP rank.

    ``sync_ranks=True`` keeps all ranks stepping until every rank is done (transformers'
    ``synced_gpus``); it is required when the module is sharded (FSDP), where each forward is a
    collective, and wasteful otherwise.
    """

    def __init__(self, module: torch.nn.Module, config: RolloutConfig, sync_ranks: bool = False):
        self.module = module
        self.config = config
        self.sync_ranks = sync_ranks
        self.pad_token_id, self.eos_token_ids = special_token_ids(
            module.config, getattr(module, "generation_config", None))
        if dist.is_initialized():
            self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        else:
            self.dp_rank, self.dp_size = 0, 1
        self.is_collect = True

    def _generation_config(self, settings):
        from transformers import GenerationConfig

        # an empty list (ignore_eos, no extra stop ids) stops at nothing; None would mean the
        # checkpoint's EOS
        kwargs = dict(max_new_tokens=settings.max_tokens, num_beams=1,
                      eos_token_id=list(settings.stop_token_ids), pad_token_id=self.pad_token_id,
                      output_scores=True, return_dict_in_generate=True)
        if settings.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p,
                          top_k=settings.top_k if settings.top_k > 0 else 0)
        return GenerationConfig(**kwargs)

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        settings = resolve_sampling(self.config, prompts.meta_info, self.eos_token_ids)
        prompt_token_lists(prompts, self.config.prompt_length)  # validates prompt lengths
        device = next(self.module.parameters()).device
        input_ids = prompts.batch["input_ids"].repeat_interleave(settings.n, dim=0).to(device)
        attention_mask = prompts.batch["attention_mask"].repeat_interleave(settings.n, dim=0)
        was_training = self.module.training
        self.module.eval()
        try:
            out = self.module.generate(input_ids=input_ids, attention_mask=attention_mask.to(device),
                                       generation_config=self._generation_config(settings),
                                       synced_gpus=self.sync_ranks and self.dp_size > 1)
        finally:
            self.module.train(was_training)
            _reshard(self.module)
        generated = out.sequences[:, input_ids.shape[1]:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [rows, steps, vocab]
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        rows = [truncate_at_stop(g.tolist(), lp.tolist(), settings.stop_token_ids, settings.max_tokens)
                for g, lp in zip(generated, log_probs)]
        samples = [rows[i * settings.n:(i + 1) * settings.n] for i in range(len(prompts))]
        return build_rollout_batch(prompts, samples, self.config.response_length, self.pad_token_id)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the module (a no-op in use: it *is* the actor's module)."""
        params = self.module.state_dict(keep_vars=True)  # includes a tied lm_head.weight alias
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"HFRollout.update_weights: the module has no parameter {name!r}")
                params[name].copy_(tensor)

    def release_memory(self) -> None:
        """Nothing to free: generation uses the training module and a per-call KV cache."""

    def resume_memory(self) -> None:
        """Nothing to restore (see release_memory)."""
