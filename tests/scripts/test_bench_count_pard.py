"""The parallel draft's training layout (scripts/bench/workloads/count_pard.py): one forward over
every cut point of a sequence gives, at each mask, what the draft computes in vLLM's parallel
drafting (the context up to the cut, then the masks), and each label is the token that many places
on. The training itself runs in the benchmark (it needs the distilled data)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))

from workloads.count_pard import make_batch, pard_blocks, pard_layout  # noqa: E402

MASK = 99


def test_each_mask_sees_its_cut_and_the_masks_before_it():
    source, pos, labels, allowed = pard_layout(7, 3)
    block = pard_blocks(7, 3)
    # block 0 is the sequence (causal); block j holds masks at positions 3 + j .. 5
    assert block.tolist() == [0] * 7 + [1, 1, 2] and pos.tolist() == list(range(7)) + [4, 5, 5]
    assert source.tolist() == list(range(7)) + [-1, -1, -1]
    # labels from the cut on (the answer's first token), each the token after its position
    assert labels.tolist() == [-1, -1, -1, 4, 5, 6, -1, 5, 6, 6]
    # the 2nd mask after cut 3 (position 5): tokens 0-3, then the 1st mask of cut 3, then itself
    assert allowed[9].nonzero().flatten().tolist() == [0, 1, 2, 3, 7, 9]
    assert allowed[:7, :7].equal(torch.ones(7, 7, dtype=torch.bool).tril()) and not allowed[:7, 7:].any()


def test_one_forward_equals_the_draft_at_every_cut(tmp_path):
    from hybridflow.tiny import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(str(tmp_path / "draft"), "qwen2", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokens, first = [5, 9, 14, 3, 22, 17, 8, 30, 11], 4
    ids, positions, mask, labels = make_batch([(tokens, first), (tokens[:6], 2)], MASK, 0)
    block = pard_blocks(len(tokens), first)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0]
        for t, (j, q) in enumerate(zip(block.tolist(), positions[0].tolist())):
            cut = q - j
            alone = torch.tensor([tokens[:cut + 1] + [MASK] * j])
            torch.testing.assert_close(got[t], model(input_ids=alone).logits[0, -1], atol=1e-4, rtol=0)
            if labels[0, t] >= 0:
                assert labels[0, t] == tokens[q + 1] and cut >= first
