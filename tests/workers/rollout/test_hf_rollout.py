"""The transformers rollout: layout, log-probs against a full forward, stops, weight updates."""
import pytest
import torch
from safetensors.torch import load_file

from tests.workers.rollout.common import (MODELS, PROMPT_LEN, RESPONSE_LEN, assert_layout,
                                          load_hf, make_checkpoints, make_prompts,
                                          reference_log_probs)
from workers.rollout.base import RolloutConfig
from workers.rollout.hf_rollout import HFRollout

CONFIG = RolloutConfig(name="hf", prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)


@pytest.fixture(scope="module", params=list(MODELS))
def ckpts(request, tmp_path_factory):
    return make_checkpoints(tmp_path_factory.mktemp("hf"), request.param)


def test_greedy_tokens_are_argmax_of_a_full_forward(ckpts):
    model = load_hf(ckpts[0])
    rollout = HFRollout(model, CONFIG)
    prompts = make_prompts(ckpts[0], meta={"do_sample": False})
    out = rollout.generate_sequences(prompts)
    assert_layout(out, prompts, 1, rollout.eos_token_ids, rollout.pad_token_id)
    b = out.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, PROMPT_LEN - 1:-1]
    m = b["response_mask"].bool()
    assert torch.equal(logits.argmax(-1)[m], b["responses"][m])
    torch.testing.assert_close(b["rollout_log_probs"], reference_log_probs(model, out), atol=1e-4, rtol=0)


def test_sampling_n4_log_probs_and_stops(ckpts):
    torch.manual_seed(0)
    model = load_hf(ckpts[0])
    rollout = HFRollout(model, CONFIG)
    stops = list(range(3, 40))  # ~30% of the char vocab: responses of very different lengths
    prompts = make_prompts(ckpts[0], meta={"n": 4, "temperature": 0.7, "stop_token_ids": stops})
    out = rollout.generate_sequences(prompts)
    all_stops = set(stops) | set(rollout.eos_token_ids)
    assert_layout(out, prompts, 4, all_stops, rollout.pad_token_id)
    lengths = out.batch["response_mask"].sum(1)
    assert lengths.min() < RESPONSE_LEN and lengths.max() > 1  # the setup really varies lengths
    torch.testing.assert_close(out.batch["rollout_log_probs"],
                               reference_log_probs(model, out, temperature=0.7), atol=1e-4, rtol=0)


def test_stop_at_first_token_and_cut_at_max_tokens(ckpts):
    model = load_hf(ckpts[0])
    rollout = HFRollout(model, CONFIG)
    free = rollout.generate_sequences(make_prompts(ckpts[0], meta={"do_sample": False}))
    first = int(free.batch["responses"][0, 0])
    prompts = make_prompts(ckpts[0], meta={"do_sample": False, "stop_token_ids": [first],
                                           "max_tokens": 6})
    out = rollout.generate_sequences(prompts)
    lengths = out.batch["response_mask"].sum(1).tolist()
    assert lengths[0] == 1 and out.batch["responses"][0, 0] == first
    for i in range(1, len(lengths)):  # the others: greedy text up to the stop token or 6 tokens
        expect = free.batch["responses"][i, :6].tolist()
        if first in expect:
            expect = expect[: expect.index(first) + 1]
        assert out.batch["responses"][i, : lengths[i]].tolist() == expect
    assert 6 in lengths  # at least one row is cut at max_tokens


def test_update_weights_changes_outputs_to_new_model(ckpts):
    model = load_hf(ckpts[0])
    rollout = HFRollout(model, CONFIG)
    new_weights = load_file(f"{ckpts[1]}/model.safetensors")
    rollout.update_weights(new_weights.items())
    prompts = make_prompts(ckpts[0], meta={"do_sample": False})
    out = rollout.generate_sequences(prompts)
    expect = HFRollout(load_hf(ckpts[1]), CONFIG).generate_sequences(prompts)
    assert torch.equal(out.batch["responses"], expect.batch["responses"])
    torch.testing.assert_close(out.batch["rollout_log_probs"], expect.batch["rollout_log_probs"])
