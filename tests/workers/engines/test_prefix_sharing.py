"""Prefix sharing (workers/engines/prefix_sharing.py) on plain single-process HF models: the
shared-prompt forward gives the per-row forward's outputs and gradients, for a causal LM (tied
Qwen2, untied Llama) and a token-classification critic."""
from __future__ import annotations

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch
from workers.engines.base import active_span
from workers.engines.prefix_sharing import distinct_prompts, saves_enough, shared_prefix_logits

P, R, VOCAB = 8, 6, 128


def grouped_batch(prompts: int, n: int, seed: int):
    b = make_grouped_rl_batch(prompts, n, P, R, VOCAB, seed=seed).batch
    return b["input_ids"], b["attention_mask"], b["position_ids"]


def per_row_logits(model, ids, mask, pos, start, end):
    # the textbook forward the engine uses without sharing: every row, every column up to end-1
    out = model(input_ids=ids[:, start:end - 1], attention_mask=mask[:, start:end - 1],
                position_ids=pos[:, start:end - 1]).logits
    return out[:, P - 1 - start:]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for arch, tied in (("qwen2", True), ("llama", False)):
        path = make_tiny_checkpoint(str(root / arch), arch=arch, tied=tied, layers=2, seed=0)
        out[arch] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(root / "qwen2"), num_labels=1)
    torch.manual_seed(0)
    out["critic"] = AutoModelForTokenClassification.from_pretrained(str(root / "qwen2"), config=config,
                                                                    dtype=torch.float32)
    for model in out.values():
        model.config.use_cache = False  # as the engine sets it: sharing must not depend on it
    return out


@pytest.mark.parametrize("name", ["qwen2", "llama", "critic"])
def test_shared_forward_equals_per_row_forward_and_gradients(models, name):
    model = models[name]
    ids, mask, pos = grouped_batch(prompts=3, n=4, seed=1)
    start, end = active_span(mask, P)
    shared = distinct_prompts(ids, mask, pos, start, P)
    assert len(shared[0]) == 3 and shared[1].tolist() == sorted(shared[1].tolist())
    assert saves_enough(shared[0], len(ids), P - start, end - 1 - start)

    params = [p for p in model.parameters() if p.requires_grad]
    want = per_row_logits(model, ids, mask, pos, start, end)
    got = shared_prefix_logits(model, ids, mask, pos, start, P, end, *shared, critic=name == "critic")
    assert got.shape == want.shape
    real = mask[:, P:end].bool()  # outputs at response padding are never used
    assert (got - want)[real].abs().max() < 1e-5

    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0)) * real[..., None]
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    for w, g in zip(want_grads, got_grads):
        assert torch.allclose(g, w, atol=1e-5 * max(1.0, float(w.abs().max())), rtol=0)


def test_single_response_column_needs_no_second_pass(models):
    model = models["qwen2"]
    ids, mask, pos = grouped_batch(prompts=2, n=3, seed=2)
    mask[:, P + 1:] = 0  # every response is one token long
    start, end = active_span(mask, P)
    assert end == P + 1
    shared = distinct_prompts(ids, mask, pos, start, P)
    got = shared_prefix_logits(model, ids, mask, pos, start, P, end, *shared)
    want = per_row_logits(model, ids, mask, pos, start, end)
    assert got.shape == (6, 1, want.shape[-1]) and (got - want).abs().max() < 1e-5


def test_no_sharing_when_prompts_differ_or_the_saving_is_small(models):
    ids, mask, pos = grouped_batch(prompts=4, n=1, seed=3)  # every prompt distinct
    start, end = active_span(mask, P)
    first_rows, inverse = distinct_prompts(ids, mask, pos, start, P)
    assert first_rows.tolist() == inverse.argsort().tolist() and len(first_rows) == 4
    assert not saves_enough(first_rows, 4, P - start, end - 1 - start)
    # still exact when run anyway (a sharded engine does, to keep its collectives in step with a rank that shares)
    got = shared_prefix_logits(models["llama"], ids, mask, pos, start, P, end, first_rows, inverse)
    want = per_row_logits(models["llama"], ids, mask, pos, start, end)
    assert (got - want)[mask[:, P:end].bool()].abs().max() < 1e-5
    # the same tokens but a different padding make a different prompt (the cache would differ)
    ids, mask, pos = grouped_batch(prompts=1, n=2, seed=4)
    mask[1, 0], ids[1, 0] = 1 - mask[0, 0], 7
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert len(distinct_prompts(ids, mask, pos, 0, P)[0]) == 2
    # a 1-column prompt shared by 2 rows of 30 columns saves under MIN_SAVED_FRACTION
    ids = torch.randint(3, VOCAB, (2, 31))
    ids[1, 0] = ids[0, 0]
    ones = torch.ones_like(ids)
    first_rows, _ = distinct_prompts(ids, ones, ones.cumsum(-1) - 1, 0, 1)
    assert len(first_rows) == 1 and not saves_enough(first_rows, 2, 1, 30)


def test_the_prompt_pass_computes_vocabulary_logits_at_its_last_position_only(models):
    # only that position predicts a response token; the others' [U, prompt, V] logits were waste
    model = models["llama"]
    ids, mask, pos = grouped_batch(prompts=3, n=4, seed=1)
    start, end = active_span(mask, P)
    positions = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: positions.append(args[0].shape[:2]))
    try:
        shared_prefix_logits(model, ids, mask, pos, start, P, end, *distinct_prompts(ids, mask, pos, start, P))
    finally:
        hook.remove()
    assert [tuple(s) for s in positions] == [(3, 1), (12, end - 1 - P)]
