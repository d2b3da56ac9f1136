"""The plain-PyTorch training loops of ``engines.py``: the single-process textbook loop, and each
engine layout written by hand, its equal-work baseline.

An engine's *framework overhead* is what it costs beyond the parallel layout it runs. Comparing
Megatron tp=2 with two communication-free processes charges the engine for tensor parallelism's
own all-reduces; on a CPU, where they cross TCP loopback, that is most of the gap and no framework
can remove it. So each layout also runs here the way a user would write it with PyTorch's own
parallel APIs, on the same HF model, data, loss and optimizer, with the same ranks and threads:

- ``fsdp2``: ``fully_shard`` on every decoder layer and the root (the FSDP2 tutorial's recipe);
- ``ddp``: ``DistributedDataParallel`` around the model;
- ``tp``: ``parallelize_module`` with the Megatron-style plan (q/k/v and gate/up column-parallel,
  o and down row-parallel) on DTensors; embeddings, norms and head replicated;
- ``pp``: ``torch.distributed.pipelining``, two stages (embeddings + first half of the layers;
  second half + norm + head), ``Schedule1F1B`` over the same micro-batches.

Each returns a ``step()`` that does forward, the response-token NLL (token mean over the global
batch), backward, gradient clipping at 1.0 and a fused AdamW step, on fp32 weights; ``bf16``
computes in bf16 the usual way (autocast; FSDP2 through its MixedPrecisionPolicy, as the engine).
The process group must already be initialised (2 ranks).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _compute(device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def load_hf(ckpt: str, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device)
    model.config.use_cache = False
    model.train()
    return model


def _nll(logits, responses, mask):
    logp = torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def textbook_step(model, forward, batch, lr, compute):
    """Forward (through ``forward``: the model or its DDP / FSDP2 wrapping) -> response-token NLL ->
    backward -> clip -> AdamW, on one process's rows. Under fsdp2 / ddp each rank holds a half of
    the rows and gradients are averaged over ranks, which equals the global token mean here (every
    row has the same number of response tokens)."""
    # same optimizer settings as workers/engines/optim.py (fused AdamW)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    resp_len = batch["responses"].shape[1]
    mask = batch["response_mask"].float()

    def step():
        opt.zero_grad(set_to_none=True)
        # logits only where they predict a response token (the engines do the same)
        with compute:
            logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"], logits_to_keep=resp_len + 1).logits[:, :resp_len]
        _nll(logits, batch["responses"], mask).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    # read by tests/scripts/test_bench_plain_pytorch_layouts.py: the model, and the parameters this rank trains
    step.model, step.params = model, list(model.parameters())
    return step


def single_process_step_fn(ckpt, batch, device, lr, bf16=False):
    """The reference loop: the HF model alone. bf16: fp32 weights under autocast, the usual
    plain-PyTorch mixed precision (the engines keep fp32 masters too)."""
    model = load_hf(ckpt, device)
    return textbook_step(model, model, batch, lr, _compute(device, bf16))


def fsdp2_step_fn(ckpt, batch, device, lr, bf16=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = load_hf(ckpt, device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return textbook_step(model, model, batch, lr, contextlib.nullcontext())  # FSDP2 casts


def ddp_step_fn(ckpt, batch, device, lr, bf16=False):
    model = load_hf(ckpt, device)
    return textbook_step(model, torch.nn.parallel.DistributedDataParallel(model), batch, lr,
                         _compute(device, bf16))


def tp_step_fn(ckpt, batch, device, lr, bf16=False):
    """Whole batch on both ranks; every matmul of a decoder layer split in two."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = load_hf(ckpt, device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    params = list(model.parameters())
    sharded = [p for p in params if isinstance(p, DTensor)]
    replicated = [p for p in params if not isinstance(p, DTensor)]
    # fused AdamW takes one kind of tensor per call; the split costs nothing (same kernels)
    opts = [torch.optim.AdamW(g, lr=lr, weight_decay=0.01, fused=True) for g in (sharded, replicated)]
    resp_len = batch["responses"].shape[1]
    mask = batch["response_mask"].float()

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        with _compute(device, bf16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], logits_to_keep=resp_len + 1).logits[:, :resp_len]
        _nll(logits, batch["responses"], mask).backward()
        # the global norm: sharded gradients' squares summed over ranks, replicated ones counted once
        sq = _squares([p.grad.to_local() for p in sharded])
        dist.all_reduce(sq)
        _clip_to_one_(params, sq + _squares([p.grad for p in replicated]))
        for o in opts:
            o.step()
    step.model, step.params = model, params
    return step


def _squares(grads) -> torch.Tensor:
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def _clip_to_one_(params, square_sum: torch.Tensor) -> None:
    """``clip_grad_norm_(params, 1.0)`` given the global sum of squares, which these layouts
    assemble themselves: torch's own reads only this rank's (local or DTensor) gradients."""
    coef = torch.clamp(1.0 / (square_sum.sqrt() + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)


class _FirstStage(torch.nn.Module):
    def __init__(self, model, layers):
        super().__init__()
        self.embed, self.rotary, self.layers = model.model.embed_tokens, model.model.rotary_emb, layers

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return _run_layers(self.layers, self.rotary, h)


class _LastStage(torch.nn.Module):
    def __init__(self, model, layers, resp_len):
        super().__init__()
        self.rotary, self.layers = model.model.rotary_emb, layers
        self.norm, self.head, self.resp_len = model.model.norm, model.lm_head, resp_len

    def forward(self, h):
        h = self.norm(_run_layers(self.layers, self.rotary, h))
        return self.head(h[:, -self.resp_len - 1:-1])  # the positions that predict response tokens


def _run_layers(layers, rotary, h):
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    cos_sin = rotary(h, positions)
    for layer in layers:  # no mask: the rows have no padding, so SDPA runs causal
        h = layer(h, position_ids=positions, position_embeddings=cos_sin)
    return h


def pp_step_fn(ckpt, batch, device, lr, micro_batches: int, bf16=False):
    """Two stages over the world group; the whole batch split into ``micro_batches`` for 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = load_hf(ckpt, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = list(model.model.layers)
    cut = len(layers) // world
    mine = torch.nn.ModuleList(layers[rank * cut:(rank + 1) * cut])
    resp_len = batch["responses"].shape[1]
    module = _FirstStage(model, mine) if rank == 0 else _LastStage(model, mine, resp_len)
    stage = PipelineStage(module, rank, world, device)
    # every micro-batch has the same number of response tokens, so the mean of the micro-batch
    # means (scale_grads) is the global token mean
    schedule = Schedule1F1B(stage, micro_batches,
                            loss_fn=lambda logits, target: _nll(logits, target, torch.ones_like(target)))
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with _compute(device, bf16):  # forwards run inside step(); backwards follow autocast's casts
            if rank == 0:
                schedule.step(batch["input_ids"])
            else:
                schedule.step(target=batch["responses"])
        sq = _squares([p.grad for p in params])
        dist.all_reduce(sq)  # each stage holds different parameters: the norm sums over both
        _clip_to_one_(params, sq)
        opt.step()
    step.model, step.params = model, params  # this rank's stage trains only its part of the model
    return step
