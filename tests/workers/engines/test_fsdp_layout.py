"""fsdp_size -> parameter layout rules (the multi-rank behaviour is in test_fsdp_engine.py)."""
import pytest

from workers.engines.fsdp_layout import resolve_shard_size


@pytest.mark.parametrize("fsdp_size,dp,expected", [(-1, 4, 4), (4, 4, 4), (2, 4, 2), (1, 4, 1), (-1, 1, 1)])
def test_shard_size_resolves(fsdp_size, dp, expected):
    assert resolve_shard_size(fsdp_size, dp) == expected


@pytest.mark.parametrize("fsdp_size,dp", [(3, 4), (8, 4), (0, 2)])
def test_shard_size_that_does_not_divide_names_the_choices(fsdp_size, dp):
    with pytest.raises(ValueError, match=rf"fsdp_size={fsdp_size} must divide the {dp} data-parallel ranks: .*one of"):
        resolve_shard_size(fsdp_size, dp)


def _collectives_on_shared_memory(rank, world, fsdp_size):
    """Which group carried each collective of one sharded/replicated training step."""
    import os

    import torch
    import torch.distributed as dist

    from hybridflow import shm_group
    from hybridflow.tiny import make_tiny_checkpoint
    from workers.engines import fsdp_layout

    calls = []
    for name in ("allreduce", "all_gather_single", "reduce_scatter_single"):
        original = getattr(shm_group.SharedMemoryGroup, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(shm_group.SharedMemoryGroup, name, counted)
    from transformers import AutoModelForCausalLM

    path = f"/tmp/hf-layout-{os.getppid()}-{fsdp_size}"  # one checkpoint, written by rank 0
    if rank == 0:
        make_tiny_checkpoint(path, seed=0)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ddp = fsdp_layout.place(model, shard_size=fsdp_layout.resolve_shard_size(fsdp_size, world),
                            dp_size=world, param_dtype="fp32", trainable=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(rank))
    (ddp or model)(input_ids=ids).logits.float().square().mean().backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters()}
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(path)
    return sorted(set(calls)), {n: g.norm().item() for n, g in grads.items()}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_size", [-1, 1], ids=["sharded", "replicated"])
def test_fsdp_collectives_go_through_shared_memory(fsdp_size):
    from tests.distributed import run_distributed

    (calls0, grads0), (calls1, grads1) = run_distributed(_collectives_on_shared_memory, 2, fsdp_size)
    expected = ["all_gather_single", "reduce_scatter_single"] if fsdp_size == -1 else ["allreduce"]
    assert calls0 == calls1 == expected
    # the ranks hold the same reduced gradients (sharded: gathered back with full_tensor)
    assert grads0.keys() == grads1.keys() and all(abs(grads0[n] - grads1[n]) < 1e-6 for n in grads0)
