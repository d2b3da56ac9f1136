"""The benchmark's plain-PyTorch layouts (scripts/bench/_plain_pytorch_layouts.py) do the engines'
work: one step of each, on 2 gloo ranks, updates the weights as one single-process step of the HF
model on the whole batch does. The framework overhead in docs/benchmarks.md is measured against
them, so a baseline that skipped work (a missing all-reduce, a wrong loss scale) would flatter it.
"""
import os
import sys

import pytest
import torch

from tests.distributed import run_distributed

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

import _plain_pytorch_layouts as baselines  # noqa: E402
import engines as bench  # noqa: E402

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE, MICRO_BATCHES = 4, 8, 16, 2
LR = 1e-3


def _batch(ckpt):
    from transformers import AutoConfig

    return bench.make_batch(ROWS, PROMPT, RESPONSE, AutoConfig.from_pretrained(ckpt).vocab_size)


def _reference(ckpt):
    """One step of the bench's single-process loop on the whole batch, in this process."""
    step = baselines.single_process_step_fn(ckpt, _batch(ckpt).batch, torch.device("cpu"), LR)
    step()
    return {name: p.detach().clone() for name, p in step.model.named_parameters()}


def _one_step_each(rank, world, ckpt):
    from torch.distributed.tensor import DTensor

    data, device, out = _batch(ckpt), torch.device("cpu"), {}
    mine = bench.rows_of(data, rank, world).batch
    for layout in ("fsdp2", "ddp", "tp", "pp"):
        if layout == "fsdp2":
            step = baselines.fsdp2_step_fn(ckpt, mine, device, LR)
        elif layout == "ddp":
            step = baselines.ddp_step_fn(ckpt, mine, device, LR)
        elif layout == "tp":
            step = baselines.tp_step_fn(ckpt, data.batch, device, LR)
        else:
            step = baselines.pp_step_fn(ckpt, data.batch, device, LR, MICRO_BATCHES)
        step()
        trained = {id(p) for p in step.params}
        out[layout] = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for name, p in step.model.named_parameters() if id(p) in trained}
    return out


def test_each_layout_updates_the_weights_as_one_process_does(tmp_path):
    from hybridflow.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), arch="qwen2", tied=False, hidden=64, layers=4,
                                heads=4, kv_heads=2, intermediate=128)
    reference = _reference(ckpt)
    by_rank = run_distributed(_one_step_each, 2, ckpt)
    for layout in ("fsdp2", "ddp", "tp", "pp"):
        names = set().union(*(r[layout] for r in by_rank))
        assert names == set(reference), f"{layout} does not train every parameter"
        for result in by_rank:
            for name, got in result[layout].items():
                if "k_proj.bias" in name:
                    # its gradient is zero in exact arithmetic (softmax ignores a shift of every
                    # score), so Adam's first step turns rounding noise into a full-size update
                    continue
                # Adam's first step moves each weight by about lr * sign(grad): a gradient that
                # missed a rank's rows or a micro-batch flips signs and misses by ~2 * LR; an
                # element whose gradient is near Adam's eps may move by a few percent of LR
                torch.testing.assert_close(got, reference[name], atol=LR / 20, rtol=0,
                                           msg=lambda m: f"{layout} {name}: {m}")
