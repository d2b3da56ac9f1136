"""MegatronEngine: the TrainEngine protocol with tensor (TP), pipeline (PP) and data (DP) parallelism.

The model is ``workers.models.transformer.MegatronCausalLM`` (megatron-core TP layers; GPTModel
needs CUDA), ranks are laid out by megatron-core's ``parallel_state`` (``rank = tp_rank + tp *
(dp_rank + dp * pp_rank)``), micro-batches flow through the 1F1B schedule of megatron_pipeline.py.

One optimizer step (``train_batch``), in order: 1F1B forward/backward of every micro-batch (each
loss scaled by ``micro_rows / mini_rows``, base.py) -> tied-embedding gradient all-reduce between
the first and last stage (PP > 1) -> gradient average over the DP group -> global grad-norm over
the TP x PP ranks (replicated tensors counted once) -> clip -> AdamW -> LR schedule.
Rows that repeat a prompt (GRPO's n samples) run it once per micro-batch and stage
(``share_prompt_prefix``; ``MegatronCausalLM`` puts prompts and responses in one flat sequence,
so each linear layer and its TP collective still runs once). Outputs (log-probs, values,
metrics) are broadcast from the last stage, so every rank returns
them; the collect rank is TP rank 0 of the last stage. ``param_dtype="bf16"``: bf16 parameters
for compute, fp32 master weights, gradients reduced in fp32 (megatron's mixed-precision recipe).
``reverse_pipeline`` puts stage ``s`` on pipeline rank ``P-1-s`` (RLHFuse's reversed critic, fused
with the actor: megatron_fused.py); ``self.stage`` is this rank's stage, ``self.pp_rank`` its place
in megatron's pipeline group.
"""
from __future__ import annotations

import math
import os
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor

from hybridflow import device as hf_device
from hybridflow import shm_group
from hybridflow.model_overrides import load_hf_config
from workers.engines.base import (META_MINI_BATCH_ROWS, LossFn, active_span, compact_rows, local_metric_means,
                                  mean_over_ranks, mini_batch_meta, refuse_padded_rows, skipped_rows_frac)
from workers.engines import prefix_sharing
from workers.engines.config import EngineConfig
from workers.engines.hf_export import write_hf_checkpoint
from workers.engines.length_order import in_length_order, restore_order
from workers.engines.logprob import response_log_probs
from workers.engines.megatron_pipeline import (Schedule, StageLink, forward_only, no_work, reversed_p2p_group,
                                               run_blocking, schedule_1f1b)
from workers.engines.megatron_state import GradientSync, load_sharded, save_sharded
from workers.engines.offload import HostOffload
from workers.engines.optim import build_optimizer, build_scheduler, move_optimizer_state
from workers.engines.token_budget import micro_batches
from workers.models.convert import export_hf, load_stage
from workers.models.layout import ModelDims
from workers.models.transformer import PARAM_DTYPES, MegatronCausalLM, SharedPrompts, parallel_config
from workers.models.vocab_parallel import vocab_parallel_response_outputs

ROLES = ("actor", "ref", "critic")


def init_model_parallel(tp: int, pp: int) -> None:
    """Build megatron-core's process groups once per process; refuse a different layout later."""
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not tp*pp*dp for tp={tp}, pp={pp}: choose tp and pp whose "
                         f"product divides the number of workers ({world})")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"this process already runs megatron with tp={have[0]}, pp={have[1]}; engines "
                             f"sharing a process must use the same tp/pp (got tp={tp}, pp={pp})")
        return
    # gloo side groups are only for megatron's distributed optimizer, which is not used here
    ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    _all_reduce_through_shared_memory()


def _all_reduce_through_shared_memory() -> None:
    """Asked for with ``HYBRIDFLOW_SHM_COLLECTIVES=1`` on one CPU host: swap megatron's
    tensor-parallel groups for groups on the same ranks whose all-reduces go through shared memory
    (hybridflow/shm_group.py). TP all-reduces sit on the critical path of every layer, forward and
    backward, where gloo pays ~1-2 ms of latency each (6 MB: 9.6 ms over gloo, 2 ms this way).
    Only TP: the data-parallel gradient all-reduce waits for the slower rank, and the kernel spins
    while it waits (e2e medium at dp=2: update 3.76 s with it, 3.30 s on gloo). megatron-core
    builds its groups with the default backend and takes no other, so the swap happens here,
    before any layer captures a group."""
    if not shm_group.enabled() or ps.get_tensor_model_parallel_world_size() < 2:
        return
    mine = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for ranks in sorted({tuple(r) for r in every}):  # new_group is collective: same order everywhere
        group = shm_group.new_group(ranks)
        if list(ranks) == mine:
            ps._TENSOR_MODEL_PARALLEL_GROUP = group


class TrainStep(NamedTuple):
    meta: dict  # the mini-batch totals (base.mini_batch_meta)
    micros: list
    schedule: Schedule
    skipping: bool  # skip_rows was given: report skipped_rows_frac


class MegatronEngine:
    def __init__(self, config: EngineConfig, model_path: str, role: str):
        self.config = config.validate()
        if config.strategy != "megatron":
            raise ValueError(f"MegatronEngine got strategy={config.strategy!r}; set strategy='megatron'")
        if role not in ROLES:
            raise ValueError(f"MegatronEngine role={role!r} is unknown; use one of {ROLES}")
        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine needs an initialised torch.distributed world; call "
                               "hybridflow.device.init_distributed() (or Worker.init_distributed()) first")
        self.role, self.model_path = role, model_path
        # the layers read their sizes, norms' eps and rope from it; save_hf and checkpoints write it
        self.hf_config = load_hf_config(model_path, config.override_config)
        self.weights_version = 0  # counts weight changes (steps, loads): the rollout syncs when it moves
        self.dims = ModelDims.from_hf(self.hf_config)
        self.tp, self.pp = config.tp, config.pp
        self.dims.check_parallel(self.tp, self.pp)
        init_model_parallel(self.tp, self.pp)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.reversed = bool(config.reverse_pipeline) and self.pp > 1
        self.pp_group = ps.get_pipeline_model_parallel_group()
        # global rank of each stage: the pipeline group's ranks in order, backwards when reversed
        self.stage_ranks = [dist.get_global_rank(self.pp_group, r) for r in range(self.pp)]
        if self.reversed:
            self.stage_ranks.reverse()
        self.stage = self.pp - 1 - self.pp_rank if self.reversed else self.pp_rank
        self.is_last_stage = self.stage == self.pp - 1
        self.is_collect = self.tp_rank == 0 and self.is_last_stage
        self.device = hf_device.torch_device(int(os.environ.get("LOCAL_RANK", "0")))

        torch.manual_seed(config.seed)  # the critic's fresh score head: identical on every rank
        cfg = parallel_config(self.tp, self.pp, PARAM_DTYPES[config.param_dtype])
        self.model = MegatronCausalLM(self.hf_config, self.dims, cfg, self.stage,
                                      head="value" if role == "critic" else "lm",
                                      gradient_checkpointing=config.gradient_checkpointing and role != "ref")
        load_stage(self.model, model_path, self.dims, self.tp, self.tp_rank, self.pp, self.stage)
        self.model.to(self.device)
        if role == "ref":
            self.model.requires_grad_(False)
        self.link = StageLink(None if self.stage == 0 else self.stage_ranks[self.stage - 1],
                              None if self.is_last_stage else self.stage_ranks[self.stage + 1],
                              cfg.params_dtype, self.device, reversed_p2p_group() if self.reversed else None)

        self.optimizer = self.scheduler = self.grads = None
        if role != "ref":
            self.grads = GradientSync(self.model, self.dims, self.tp, self.pp, self.tp_rank, self.stage)
            self.optimizer = build_optimizer(self.grads.master_params, config)
            self.scheduler = build_scheduler(self.optimizer, config)
        self.memory = HostOffload(self.device, self.model.to, self._move_optimizer,
                                  params_rest_on_host=config.param_offload,
                                  optimizer_rest_on_host=config.optimizer_offload)
        self.memory.rest()

    # ------------------------------------------------------------------ one micro-batch on this stage
    def _stage_forward(self, micro, hidden: Tensor | None, span: tuple[int, int]) -> Tensor:
        batch = micro.batch
        start, end = span
        cols = slice(start, end)
        input_ids, position_ids, attention_mask = (batch[k][:, cols].to(self.device) for k in
                                                   ("input_ids", "position_ids", "attention_mask"))
        return self.model(input_ids, position_ids, attention_mask, hidden=hidden,
                          shared=self._shared_prompts(micro, input_ids, attention_mask, position_ids, span))

    def _shared_prompts(self, micro, input_ids, attention_mask, position_ids, span) -> SharedPrompts | None:
        """Which rows repeat a prompt, if sharing pays (prefix_sharing.py). The TP and PP peers of
        a rank hold the same micro-batch, so they all decide alike and their collectives match."""
        if not self.config.share_prompt_prefix:
            return None
        start, end = span
        prompt_len = micro.batch["input_ids"].shape[1] - micro.batch["responses"].shape[1]
        p = prompt_len - start
        if p <= 0 or end <= prompt_len:
            return None
        first_rows, inverse = prefix_sharing.distinct_prompts(input_ids, attention_mask, position_ids, 0, p)
        if not prefix_sharing.saves_enough(first_rows, len(input_ids), p, end - start):
            return None
        return SharedPrompts(first_rows, inverse, p)

    def _head_outputs(self, micro, hidden: Tensor, span: tuple[int, int], temperature: float,
                      calculate_entropy: bool) -> dict[str, Tensor]:
        """Last stage: ``[m, R]`` outputs; position ``P + t - 1`` is read for response token ``t``."""
        batch = micro.batch
        resp_len = batch["responses"].shape[1]
        prompt_len = batch["input_ids"].shape[1] - resp_len
        start, end = span
        kept = end - prompt_len  # response columns that hold a real token in some row
        head_in = hidden[:, prompt_len - 1 - start: prompt_len - 1 - start + kept]
        resp_real = batch["attention_mask"][:, prompt_len:].to(self.device).bool()
        pad = (0, resp_len - kept)
        if self.role == "critic":
            values = torch.nn.functional.pad(self.model.values(head_in).float(), pad)
            return {"values": torch.where(resp_real, values, torch.zeros_like(values))}
        labels = batch["input_ids"][:, prompt_len: prompt_len + kept].to(self.device)
        logits = self.model.logits(head_in)
        if ps.get_tensor_model_parallel_world_size() == 1:  # the whole vocabulary is here: fused path
            log_probs, entropy = response_log_probs(logits, labels, temperature, calculate_entropy)
        else:
            log_probs, entropy = vocab_parallel_response_outputs(logits, labels, temperature, calculate_entropy)
        out = {"log_probs": log_probs, "entropy": entropy} if entropy is not None else {"log_probs": log_probs}
        out = {k: torch.nn.functional.pad(v, pad) for k, v in out.items()}
        return {k: torch.where(resp_real, v, torch.zeros_like(v)) for k, v in out.items()}

    def _plan(self, data, micro_batch_size: int, max_tokens: int | None):
        micros = micro_batches(data, micro_batch_size, max_tokens, ps.get_data_parallel_group(), self.device)
        resp_len = data.batch["responses"].shape[1]
        prompt_len = data.batch["input_ids"].shape[1] - resp_len
        spans = [active_span(m.batch["attention_mask"], prompt_len) for m in micros]

        def shape_of(i: int) -> tuple[int, ...]:
            return (len(micros[i]), spans[i][1] - spans[i][0], self.dims.hidden_size)
        return micros, spans, shape_of

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def _infer(self, data, temperature: float, calculate_entropy: bool) -> dict[str, Tensor]:
        data, order = in_length_order(data, self.config.group_by_length, self.config.infer_micro,
                                      self.config.infer_max_token_len_per_gpu, self.config.share_prompt_prefix)
        micros, spans, shape_of = self._plan(data, self.config.infer_micro, self.config.infer_max_token_len_per_gpu)
        self.model.eval()

        def step(i: int, hidden: Tensor | None):
            out = self._stage_forward(micros[i], hidden, spans[i])
            if not self.is_last_stage:
                return out
            return self._head_outputs(micros[i], out, spans[i], temperature, calculate_entropy)

        with self.memory.params_on_device():
            parts = forward_only(self.link, len(micros), shape_of, step)
        keys = ["values"] if self.role == "critic" else ["log_probs"] + (["entropy"] if calculate_entropy else [])
        resp_len = data.batch["responses"].shape[1]
        out = {}
        for key in keys:
            tensor = (torch.cat([p[key] for p in parts]) if self.is_last_stage
                      else torch.empty(len(data), resp_len, dtype=torch.float32, device=self.device))
            if self.pp > 1:  # every stage returns the outputs (the collect rank is on the last one)
                dist.broadcast(tensor, src=self.stage_ranks[-1], group=self.pp_group)
            out[key] = restore_order(order, tensor.cpu())
        return out

    def compute_log_prob(self, data, temperature: float,
                         calculate_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        if self.role == "critic":
            raise RuntimeError("MegatronEngine.compute_log_prob: a critic engine has no LM head; use compute_values")
        out = self._infer(data, temperature, calculate_entropy)
        return out["log_probs"], out.get("entropy")

    def compute_values(self, data) -> Tensor:
        if self.role != "critic":
            raise RuntimeError(f"MegatronEngine.compute_values: role {self.role!r} has no value head; build "
                               "the engine with role='critic'")
        return self._infer(data, 1.0, False)["values"]

    # ------------------------------------------------------------------ training
    def train_batch(self, data, loss_fn: LossFn, skip_rows: Tensor | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (loss scaling: base.py).

        ``data.meta_info`` may carry ``temperature`` (default 1.0) and ``calculate_entropy``.
        ``skip_rows`` (bool ``[rows]``) marks rows whose loss is identically zero: they count in
        the loss denominators but are not computed (``base.compact_rows``; TP and PP peers hold
        the same rows, so they make the same choice). Three phases, which megatron_fused.py
        interleaves with another engine's: ``begin_step``, driving its schedule, ``apply_gradients``
        and ``finish_step``.
        """
        step = self.begin_step(data, loss_fn, skip_rows)
        with self.memory.params_on_device():
            results = run_blocking(step.schedule)
            grad_norm = self.apply_gradients()
        return self.finish_step(step, results, grad_norm)

    def begin_step(self, data, loss_fn: LossFn, skip_rows: Tensor | None = None) -> TrainStep:
        """Split the mini-batch into micro-batches and zero the gradients; the returned step's
        ``schedule`` (a megatron_pipeline.Schedule) runs every forward/backward when driven."""
        if self.optimizer is None:
            raise RuntimeError("MegatronEngine.train_batch: the 'ref' role is frozen; build the engine with "
                               "role='actor' or 'critic' to train")
        refuse_padded_rows(data, self.dp_size)
        dp_group = ps.get_data_parallel_group()
        meta = mini_batch_meta(data, self.dp_size, dp_group, self.device)
        data = compact_rows(data, skip_rows, dp_group, self.device)
        # a mini-batch loss: no order to restore
        data, _ = in_length_order(data, self.config.group_by_length, self.config.micro_batch_size_per_gpu,
                                  self.config.max_token_len_per_gpu, self.config.share_prompt_prefix)
        rows = len(data) if data is not None else 0
        micros, spans, shape_of = [], [], None
        if rows:
            micros, spans, shape_of = self._plan(data, self.config.micro_batch_size_per_gpu,
                                                 self.config.max_token_len_per_gpu)
        info = data.meta_info if data is not None else {}
        temperature = float(info.get("temperature", 1.0))
        calculate_entropy = bool(info.get("calculate_entropy", False))
        for micro in micros:
            micro.meta_info.update(meta, **{META_MINI_BATCH_ROWS: rows})

        def step(i: int, hidden: Tensor | None):
            out = self._stage_forward(micros[i], hidden, spans[i])
            if not self.is_last_stage:
                return out
            outputs = self._head_outputs(micros[i], out, spans[i], temperature, calculate_entropy)
            loss, metrics = loss_fn(outputs, micros[i].to(self.device))
            return loss * (len(micros[i]) / rows), {k: float(v) for k, v in metrics.items()}

        self.model.train()
        self.grads.zero()
        # no micro-batch left anywhere: the gradient is zero (reduce_and_clip reads missing
        # grads as zeros) and the optimizer still steps, as it would on a zero loss
        schedule = (schedule_1f1b(self.link, len(micros), shape_of, step, self.stage, self.pp)
                    if micros else no_work())
        return TrainStep(meta, micros, schedule, skip_rows is not None)

    def apply_gradients(self) -> float:
        """Reduce, clip and apply the accumulated gradients (parameters on the device); the norm."""
        grad_norm = self.grads.reduce_and_clip(self.config.grad_clip)
        if math.isfinite(grad_norm):
            self.memory.optimizer_on_device()
            self.optimizer.step()
            self.grads.copy_master_to_model()
            self.weights_version += 1
        return grad_norm

    def finish_step(self, step: TrainStep, results: list, grad_norm: float) -> dict[str, float]:
        """The learning-rate schedule and the step's metrics (the same dict on every rank)."""
        # a non-finite gradient skips the update but not the schedule, so the lr stays on plan
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.grads.zero()
        result, trained = self._mean_over_ranks(*local_metric_means(step.micros, results))
        result.update(grad_norm=grad_norm, lr=lr)
        if step.skipping:
            result["skipped_rows_frac"] = skipped_rows_frac(step.meta, trained)
        return result

    def _mean_over_ranks(self, metrics: dict[str, float], rows: int) -> tuple[dict[str, float], int]:
        """Metrics exist on the last stage: broadcast them over the pipeline, then take the
        row-weighted mean over the DP ranks (the same dict on every rank)."""
        if self.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=self.stage_ranks[-1], group=self.pp_group)
            metrics = box[0]
        return mean_over_ranks(metrics, rows, self.dp_size, ps.get_data_parallel_group())

    # ------------------------------------------------------------------ weights out
    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under HF names, one at a time, on every rank (a collective: all ranks must
        consume it in step). Tied models yield no ``lm_head.weight``, as their HF checkpoints."""
        with self.memory.params_on_device():
            yield from export_hf(self.model, self.dims, self.tp, self.pp, self.stage,
                                 ps.get_tensor_model_parallel_group(), self.pp_group, self.device,
                                 stage_ranks=self.stage_ranks)

    def _hf_architecture(self) -> str:
        arch = self.dims.architecture
        return arch.replace("ForCausalLM", "ForTokenClassification") if self.role == "critic" else arch

    def save_hf(self, path: str) -> None:
        """Global rank 0 writes ``model.safetensors`` + config + tokenizer; all ranks must call it."""
        weights = ((n, t.cpu()) for n, t in self.export_hf_weights())
        if dist.get_rank() == 0:
            hf_config = self.hf_config
            if self.role == "critic":
                hf_config = type(self.hf_config).from_dict({**self.hf_config.to_dict(), "num_labels": 1})
            write_hf_checkpoint(path, weights, hf_config, self._hf_architecture(), source_dir=self.model_path)
        else:
            for _ in weights:  # take part in each gather/broadcast, keep nothing
                pass
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Per-stage ``path/megatron/tp{t}_pp{stage}.pt`` (model, fp32 master weights, optimizer,
        scheduler, RNG), written by DP rank 0 (DP replicas are identical) + ``layout.json``."""
        with self.memory.all_on_device():
            save_sharded(self, path)

    def load_checkpoint(self, path: str) -> None:
        with self.memory.all_on_device():
            load_sharded(self, path)
        self.weights_version += 1

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Parameters, fp32 master weights and optimizer state to host memory while vLLM
        generates (GPU only; a no-op on CPU). See workers/engines/offload.py."""
        self.memory.offload()

    def onload(self) -> None:
        """Back to where they rest between calls (``param_offload`` / ``optimizer_offload``)."""
        self.memory.rest()

    def params_on_device(self):
        """Context: the parameters on the device for the body (a weight stream reading them)."""
        return self.memory.params_on_device()

    def _move_optimizer(self, target: torch.device) -> None:
        if self.grads is not None:
            self.grads.move_master(target)
        move_optimizer_state(self.optimizer, target)
