"""FSDPEngine: the TrainEngine protocol on HF models sharded with FSDP2 (``fully_shard``).

Data-parallel only (every rank is its own dp rank and its output is collected). ``fsdp_size``
picks how parameters are laid out over the ranks: sharded (FSDP), HSDP or replicated (DDP); see
``workers/engines/fsdp_layout.py``.

Roles:

- ``actor``/``ref``: ``AutoModelForCausalLM``; ``ref`` has no optimizer.
- ``critic``: ``AutoModelForTokenClassification`` (or the same head built for an architecture
  transformers registers none for: ``hf_model.value_model_class``) with ``num_labels=1`` loaded from the causal-LM
  checkpoint: the backbone's weights load under the same ``model.`` prefix, the LM head is dropped
  and a scalar ``score`` head is freshly initialised from ``config.seed`` (identical on every rank).
  Its dropout is set to 0 so values are deterministic. The value of response token ``t`` is read
  at position ``P + t - 1`` (the state before the token is generated), the same alignment as the
  log-probs.

Every role builds its model from the checkpoint's config with ``config.override_config`` applied
(verl's ``model.override_config``, ``hybridflow/model_overrides.py``); ``hf_config``, ``save_hf``
and checkpoints carry the overridden config.

Padding: by default each micro-batch is cut to the columns where any row has a real token
(``active_span``: left prompt padding and right response padding beyond the longest response are
never computed). With ``use_remove_padding`` all real tokens of a micro-batch are packed into one
row whose position ids restart per sequence; transformers then builds a block-diagonal causal mask,
so no padding token is computed at all. Outputs at response-padding positions are 0.
In the padded layout, rows that repeat a prompt (GRPO's n samples) share one forward of it
(``share_prompt_prefix``, ``workers/engines/prefix_sharing.py``).

``param_dtype="bf16"`` keeps fp32 sharded master weights and optimizer state and computes in bf16
(FSDP2 ``MixedPrecisionPolicy``; with ``fsdp_size=1``, ``torch.autocast``), reducing gradients in fp32.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridflow import device as hf_device
from workers.engines.base import (META_MINI_BATCH_ROWS, LossFn, active_span, compact_rows, local_metric_means,
                                  mean_over_ranks, mini_batch_meta, refuse_padded_rows, skipped_rows_frac)
from workers.engines import fsdp_checkpoint, fsdp_layout, prefix_sharing
from workers.engines.config import EngineConfig
from workers.engines.hf_export import in_checkpoint_layout, write_hf_checkpoint
from workers.engines.hf_model import load_hf_model
from workers.engines.logprob import response_log_probs, response_logits
from workers.engines.lora import add_lora, lora_scalings, merge_lora
from workers.engines.offload import HostOffload
from workers.engines.optim import build_optimizer, build_scheduler, move_optimizer_state
from workers.engines.length_order import in_length_order, restore_order
from workers.engines.token_budget import local_plans, micro_batches

ROLES = ("actor", "ref", "critic")

# FSDP2 warns when a wrapped model returns a view (the critic's value head does): an in-place op
# on it would skip the backward all-gather. The engine never edits a forward output in place
# (_forward builds new tensors with torch.where), so the warning only alarms users.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)

def _aliased_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names that point at a parameter already seen under an earlier name (tied embeddings)."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


class FSDPEngine:
    def __init__(self, config: EngineConfig, model_path: str, role: str):
        self.config = config.validate()
        if config.strategy != "fsdp":
            raise ValueError(f"FSDPEngine got strategy={config.strategy!r}; set strategy='fsdp' or use the "
                             "Megatron engine")
        if role not in ROLES:
            raise ValueError(f"FSDPEngine role={role!r} is unknown; use one of {ROLES}")
        if not dist.is_initialized():
            raise RuntimeError("FSDPEngine needs an initialised torch.distributed world; call "
                               "hybridflow.device.init_distributed() (or Worker.init_distributed()) first")
        self.role, self.model_path = role, model_path
        self.dp_rank, self.dp_size, self.is_collect = dist.get_rank(), dist.get_world_size(), True
        self.device = hf_device.torch_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.shard_size = fsdp_layout.resolve_shard_size(config.fsdp_size, self.dp_size)

        torch.manual_seed(config.seed)  # the critic's new head must start identical on all ranks
        model = load_hf_model(model_path, role, config.override_config, config.disable_dropout)
        model.config.use_cache = False
        self.hf_config = model.config
        self.weights_version = 0  # counts weight changes (steps, loads): the rollout syncs when it moves
        self.architecture = type(model).__name__
        self._alias_names = _aliased_parameter_names(model)
        if config.lora_rank:  # before anything looks at which parameters train
            add_lora(model, config.lora_rank, config.lora_alpha, config.target_modules, config.exclude_modules)
            if role == "critic":  # the value head is new: it trains in full (peft's modules_to_save)
                for name, p in model.named_parameters():
                    p.requires_grad_(not name.startswith(model.base_model_prefix + ".") or "lora_" in name)
        # {module path: alpha / r} of the adapted layers (empty without LoRA), for streams that merge them
        self.lora_scalings = lora_scalings(model)
        if config.gradient_checkpointing and role != "ref":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        # self.model stays the HF module (inference, export, checkpoints, the HF rollout); in the
        # replicated layout training forwards go through the DDP wrapper instead
        self._ddp = fsdp_layout.place(model, shard_size=self.shard_size, dp_size=self.dp_size,
                                      param_dtype=config.param_dtype, trainable=role != "ref",
                                      prefetch=config.forward_prefetch)
        self.model = model

        self.optimizer = self.scheduler = None
        if role != "ref":
            self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], config)
            self.scheduler = build_scheduler(self.optimizer, config)
        self.memory = HostOffload(self.device, self.model.to, self._move_optimizer,
                                  params_rest_on_host=config.param_offload,
                                  optimizer_rest_on_host=config.optimizer_offload)
        if self.memory.active and config.param_offload and self._ddp is not None:
            # DDP's gradient buckets stay on the device it was built on
            raise ValueError("FSDPEngine: param_offload needs a sharded layout; with fsdp_size=1 every "
                             "rank holds the whole model anyway: set fsdp_size=-1 or param_offload=false")
        self.memory.rest()

    # ------------------------------------------------------------------ forward
    def _compute_context(self):
        return fsdp_layout.compute_context(self.shard_size, self.config.param_dtype)

    def _module(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None and torch.is_grad_enabled() else self.model

    def _forward(self, micro, temperature: float, calculate_entropy: bool) -> dict[str, Tensor]:
        """Outputs for one micro-batch: log_probs (+entropy) or values, each ``[m, R]``."""
        batch = micro.batch
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        position_ids = batch["position_ids"].to(self.device)
        resp_len = batch["responses"].shape[1]
        prompt_len = input_ids.shape[1] - resp_len
        resp_real = attention_mask[:, prompt_len:].bool()
        responses = input_ids[:, prompt_len:]
        if self.config.use_remove_padding:
            head = self._packed_head_inputs(input_ids, attention_mask, position_ids, prompt_len)
        else:
            head = self._padded_head_inputs(input_ids, attention_mask, position_ids, prompt_len)
        # head: [m, R, V or 1] aligned so head[:, t] predicts response token t (padding rows may be junk)
        out = {}
        if self.role == "critic":
            values = head[..., 0].float()
            out["values"] = torch.where(resp_real, values, torch.zeros_like(values))
            return out
        log_probs, entropy = response_log_probs(head, responses, temperature, calculate_entropy)
        out["log_probs"] = torch.where(resp_real, log_probs, torch.zeros_like(log_probs))
        if entropy is not None:
            out["entropy"] = torch.where(resp_real, entropy, torch.zeros_like(entropy))
        return out

    def _padded_head_inputs(self, input_ids, attention_mask, position_ids, prompt_len) -> Tensor:
        resp_len = input_ids.shape[1] - prompt_len
        start, end = active_span(attention_mask, prompt_len)
        kept = end - prompt_len  # response columns that hold a real token in some row
        # the last column only predicts past the span, so it is never an input
        kwargs = dict(input_ids=input_ids[:, start:end - 1], attention_mask=attention_mask[:, start:end - 1],
                      position_ids=position_ids[:, start:end - 1])
        shared = None
        if self._shares_prompts():
            shared = prefix_sharing.distinct_prompts(input_ids, attention_mask, position_ids, start, prompt_len)
            # the inputs are columns [start, end - 1): the last one is never fed (see above)
            share = prefix_sharing.saves_enough(shared[0], len(input_ids), prompt_len - start, end - 1 - start)
            if self.shard_size > 1:
                share = self._ranks_agree_to_share(share, two_calls=end - 1 > prompt_len)
            shared = shared if share else None
        with self._compute_context():
            if shared is not None:
                head = prefix_sharing.shared_prefix_logits(self._module(), input_ids, attention_mask, position_ids,
                                                           start, prompt_len, end, *shared,
                                                           critic=self.role == "critic")
            elif self.role == "critic":
                head = response_logits(self._module()(**kwargs).logits, prompt_len - start, kept)
            else:
                head = self._module()(**kwargs, logits_to_keep=kept).logits
        if kept < resp_len:
            head = torch.nn.functional.pad(head, (0, 0, 0, resp_len - kept))
        return head

    def _in_length_order(self, data, rows: int, max_tokens: int | None):
        # packed micro-batches (use_remove_padding) hold no padding for the order to save
        enabled = self.config.group_by_length and not self.config.use_remove_padding
        return in_length_order(data, enabled, rows, max_tokens, self._shares_prompts())

    def _shares_prompts(self) -> bool:
        # gradient checkpointing turns transformers' cache off in training
        return self.config.share_prompt_prefix and not (self.config.gradient_checkpointing and torch.is_grad_enabled())

    def _packed_head_inputs(self, input_ids, attention_mask, position_ids, prompt_len) -> Tensor:
        real = attention_mask.bool()
        packed_ids = input_ids[real].unsqueeze(0)
        packed_pos = position_ids[real].unsqueeze(0)
        # attention_mask=None + restarting position ids: transformers detects the packed sequences
        # and masks attention block-diagonally (masking_utils.find_packed_sequence_indices).
        with self._compute_context():
            logits = self._module()(input_ids=packed_ids, position_ids=packed_pos, attention_mask=None).logits[0]
        flat_index = real.flatten().cumsum(0).view_as(real) - 1
        # a real response token's predecessor is the previous real token of the same row
        src = (flat_index[:, prompt_len:] - 1).clamp(min=0)
        return logits[src]

    def _ranks_agree_to_share(self, wanted: bool, two_calls: bool) -> bool:
        """Sharded parameters are all-gathered per model call, so every rank must make the same
        calls: share if any rank wants to (a rank with nothing to share runs the two calls anyway,
        still exact) and every rank has a response column to run on top of the cache."""
        votes = torch.tensor([int(wanted), -int(two_calls)], device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return bool(votes[0]) and int(votes[1]) == -1

    def _check_same_micro_count(self, count: int, what: str) -> None:
        # Every forward all-gathers parameters, so ranks with different micro-batch counts would hang.
        counts = torch.tensor([count, -count], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if int(counts[0]) != -int(counts[1]):
            raise ValueError(f"FSDPEngine.{what}: data-parallel ranks got different numbers of "
                             f"micro-batches ({-int(counts[1])}..{int(counts[0])}); give every rank the "
                             "same number of rows (DataProto.pad_to_divisor before chunking)")

    # ------------------------------------------------------------------ inference
    def local_inference_block(self) -> str | None:
        """Why this rank cannot infer alone (None: it can): sharded parameters are all-gathered per forward."""
        return None if self.shard_size == 1 else (f"FSDP shards parameters over {self.shard_size} ranks, so every "
                                                  "forward all-gathers them; set fsdp_size=1 for local inference")

    @torch.no_grad()
    def _infer(self, data, temperature: float, calculate_entropy: bool, what: str,
               local: bool = False) -> dict[str, Tensor]:
        """``local``: this rank alone, with no collective (replicated only); the others may do anything."""
        if local and (why := self.local_inference_block()):
            raise ValueError(f"FSDPEngine.{what}(local=True): {why}")
        data, order = self._in_length_order(data, self.config.infer_micro, self.config.infer_max_token_len_per_gpu)
        with local_plans() if local else contextlib.nullcontext():  # local: no cross-rank micro-batch count
            micros = micro_batches(data, self.config.infer_micro, self.config.infer_max_token_len_per_gpu,
                                   device=self.device)
        if not local:
            self._check_same_micro_count(len(micros), what)
        self.model.eval()
        with self.memory.params_on_device(), self._gathered():
            parts = [self._forward(m, temperature, calculate_entropy) for m in micros]
        return {k: restore_order(order, torch.cat([p[k] for p in parts]).cpu()) for k in parts[0]}

    def compute_log_prob(self, data, temperature: float, calculate_entropy: bool = False,
                         local: bool = False) -> tuple[Tensor, Tensor | None]:
        if self.role == "critic":
            raise RuntimeError("FSDPEngine.compute_log_prob: a critic engine has no LM head; use compute_values")
        out = self._infer(data, temperature, calculate_entropy, "compute_log_prob", local)
        return out["log_probs"], out.get("entropy")

    def compute_values(self, data, local: bool = False) -> Tensor:
        if self.role != "critic":
            raise RuntimeError(f"FSDPEngine.compute_values: role {self.role!r} has no value head; build "
                               "the engine with role='critic'")
        return self._infer(data, 1.0, False, "compute_values", local)["values"]

    # ------------------------------------------------------------------ training
    def train_batch(self, data, loss_fn: LossFn, skip_rows: Tensor | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (see base.py for loss scaling).

        ``data.meta_info`` may carry ``temperature`` (default 1.0) and ``calculate_entropy``.
        ``skip_rows`` (bool ``[rows]``) marks rows whose loss is identically zero: they count in
        the loss denominators but are not computed (``base.compact_rows``).
        """
        if self.optimizer is None:
            raise RuntimeError("FSDPEngine.train_batch: the 'ref' role is frozen; build the engine with "
                               "role='actor' or 'critic' to train")
        refuse_padded_rows(data, self.dp_size)
        meta = mini_batch_meta(data, self.dp_size, None, self.device)
        data = compact_rows(data, skip_rows, None, self.device)
        # a mini-batch loss: no order to restore
        data, _ = self._in_length_order(data, self.config.micro_batch_size_per_gpu, self.config.max_token_len_per_gpu)
        rows = len(data) if data is not None else 0
        micros = (micro_batches(data, self.config.micro_batch_size_per_gpu, self.config.max_token_len_per_gpu,
                                device=self.device) if rows else [])
        self._check_same_micro_count(len(micros), "train_batch")
        info = data.meta_info if data is not None else {}
        temperature = float(info.get("temperature", 1.0))
        calculate_entropy = bool(info.get("calculate_entropy", False))

        self.model.train()
        with self.memory.params_on_device():
            grad_norm, results = self._accumulate_and_step(micros, meta, rows, loss_fn, temperature,
                                                           calculate_entropy)
        # a non-finite gradient skips the update but not the schedule, so the lr stays on plan
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        result, trained = mean_over_ranks(*local_metric_means(micros, results), self.dp_size, None)
        result.update(grad_norm=grad_norm, lr=lr)
        if skip_rows is not None:
            result["skipped_rows_frac"] = skipped_rows_frac(meta, trained)
        return result

    def _accumulate_and_step(self, micros, meta, rows, loss_fn, temperature, calculate_entropy):
        """Forward and backward of every micro-batch, clip, step: (grad norm, per-micro metrics).
        The optimizer state comes to the device only for the step (``optimizer_offload``)."""
        self.optimizer.zero_grad(set_to_none=True)
        results = []
        with self._gathered():
            for index, micro in enumerate(micros):
                micro.meta_info.update(meta, **{META_MINI_BATCH_ROWS: rows})
                micro = micro.to(self.device)
                with self._accumulating(last=index == len(micros) - 1):
                    outputs = self._forward(micro, temperature, calculate_entropy)
                    loss, metrics = loss_fn(outputs, micro)
                    (loss * (len(micro) / rows)).backward()
                results.append(metrics)
        if not micros:  # every row skipped everywhere: a zero gradient, but the optimizer still steps
            for p in self._trained_params():  # (AdamW's moments and weight decay move the weights)
                p.grad = torch.zeros_like(p)

        grad_norm = self._clip_grad_norm()
        if math.isfinite(grad_norm):
            self.memory.optimizer_on_device()
            self.optimizer.step()
            self.weights_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, results

    def _gathered(self):
        return fsdp_layout.gathered_until_exit(self.model, self._ddp is None and not self.config.reshard_after_forward)

    def _accumulating(self, last: bool):
        return fsdp_layout.accumulation_context(self.model, self._ddp, shard_size=self.shard_size,
                                                dp_size=self.dp_size, last=last)

    def _trained_params(self) -> list[Tensor]:
        """The optimizer's parameters: the shards themselves, whatever state the module's own
        parameter attributes are in (FSDP2 swaps gathered copies in while a layer is unsharded)."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def _clip_grad_norm(self) -> float:
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._trained_params(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ weights out
    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under HF names, gathered one parameter at a time (a collective: every rank
        must consume the iterator in step). Tied copies (``lm_head.weight``) are left out, as in an
        HF checkpoint of a tied model; LoRA adapters come merged into their weights."""
        with self.memory.params_on_device():
            yield from in_checkpoint_layout(self.model, merge_lora(self._full_state_tensors(), self.lora_scalings))

    def _full_state_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.model.state_dict().items():
            if name in self._alias_names:
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach()

    def save_hf(self, path: str) -> None:
        """Rank 0 writes ``model.safetensors`` + config + tokenizer files; all ranks must call it."""
        weights = ((n, t.cpu()) for n, t in self.export_hf_weights())
        if self.dp_rank == 0:
            write_hf_checkpoint(path, weights, self.hf_config, self.architecture, source_dir=self.model_path)
        else:
            for _ in weights:  # take part in each gather, keep nothing
                pass
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer, this rank's scheduler and RNG (``fsdp_checkpoint.py``)."""
        with self.memory.all_on_device():
            fsdp_checkpoint.save_sharded(path, self.model, self.optimizer, self.scheduler, self.dp_rank, self.dp_size)

    def load_checkpoint(self, path: str) -> None:
        fsdp_checkpoint.check_sharded(path, self.dp_rank)
        with self.memory.all_on_device():
            fsdp_checkpoint.load_model_and_optimizer(path, self.model, self.optimizer)
        fsdp_checkpoint.load_rank_state(path, self.scheduler, self.dp_rank)
        self.weights_version += 1

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Sharded parameters and optimizer state to host memory while vLLM generates (GPU only;
        on CPU training and rollout share host memory anyway). See workers/engines/offload.py."""
        self.memory.offload()

    def onload(self) -> None:
        """Back to where they rest between calls: the device, or host memory with
        ``param_offload`` / ``optimizer_offload``."""
        self.memory.rest()

    def params_on_device(self):
        """Context: the parameters on the device for the body (a weight stream reading them)."""
        return self.memory.params_on_device()

    def _move_optimizer(self, target: torch.device) -> None:
        move_optimizer_state(self.optimizer, target)
